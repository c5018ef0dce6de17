"""shardtensor beside its peers (FSDP2, DeepSpeed ZeRO-3, DDP): peak memory per rank, wall and CPU time per step.

Every configuration trains the same GPT (``shardtensor.models``) on the same batches with AdamW, at the same world
size, in its own freshly spawned group of ranks (gloo on the CPU, a free port each), so peaks never mix:

  - ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the root
  - ``deepspeed`` / ``deepspeed-seq``: DeepSpeed ZeRO-3 (``zero_optimization: {stage: 3}``, the second with
    ``stage3_allgather_sequential: true``, the idea behind our sequential mode), torch AdamW as its client
    optimizer, ``deepspeed.init_distributed(dist_backend="gloo")``.  An optional peer: skipped, and said so in the
    output and the JSON, where ``deepspeed`` is not installed (benchmarks/README.md has the install command)
  - ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (the unsharded reference)
  - ``local``: the bare model, every rank training alone (no collectives).  It prices the floor: its peak with
    the full parameters and AdamW state replaced by one rank's shards of them is the least any ZeRO-3 that keeps
    the same activations can reach (the "ZeRO-3 floor" line)
  - ``st-sequential`` / ``st-overlapped`` / ``st-auto``: ``shardtensor.shard_module(model, gather=...)``

Memory is the growth of each rank's peak resident set from just before the model is built, so parameters,
gradients and optimizer state count for everyone, whenever a peer creates them: ``ru_maxrss`` at the end minus
psutil's RSS at the mark.  The mark comes after the libraries are imported, after AdamW has been built once (its
first construction imports ``torch._dynamo``, ~95 MiB, no configuration's memory) and after two steps of a tiny
GPT under the same configuration (code paths' one-time costs: libtorch code pages faulted in, gloo's first
collectives).  ``MALLOC_MMAP_THRESHOLD_=65536`` is in every worker's environment from its start (freed tensors
go back to the OS: the peak is the peak of live tensors, not of glibc's arena) and ``TORCH_FR_BUFFER_SIZE=0``
(c10d's flight recorder ring fills sooner for configs that issue more collectives;
``bench_memory_phases.py --flight-recorder`` shows it).  With ``--device cuda`` memory is
``torch.cuda.max_memory_allocated`` minus the allocation at the mark (nccl).

Time: each rank times every step (forward, backward, optimizer step, zero_grad) in wall seconds
(``perf_counter``) and in CPU seconds of its whole process (``time.process_time``: all its threads, gloo's
included); ranks meet at a barrier before each step, outside the timed region.  A round runs every configuration
once, one after another (each round starts one configuration further down the list, so none always runs first);
``--repeats`` rounds; ``peers_report.py`` gives medians and min/max over rounds.

    python benchmarks/bench_peers.py                              # default set, 3 rounds -> results/peers*
    python benchmarks/bench_peers.py --steps 2 --warmup 1 --repeats 1   # wiring check: losses must agree
    python benchmarks/bench_peers.py --configs fsdp2 deepspeed-seq st-sequential --repeats 5
    python benchmarks/bench_peers.py --profile st-overlapped      # cProfile of rank 0's timed steps, to a .txt

Writes ``<out>.json`` (the exact command, config, every rank's figures per round, skipped peers), ``<out>.png``
and ``<out>_table.md``; ``<out>`` is ``benchmarks/results/peers`` (``peers_cuda`` with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import resource
import shlex
import statistics
import sys
import time
from typing import Callable

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from shardtensor.launch import RankFailed, spawn_ranks  # noqa: E402

CONFIGS = ["fsdp2", "deepspeed", "deepspeed-seq", "ddp", "local", "st-sequential", "st-overlapped", "st-auto",
           "st-overlapped-persist", "st-overlapped-unchecked", "st-sequential-unchecked", "st-overlapped-cpuadam",
           "st-overlapped-blocks", "zero3-floor", "st-overlapped-gloo"]
DEFAULT_CONFIGS = CONFIGS[:8]
# "-unchecked": the cross-rank identity check off (set_divergence_check(False)), to price it in the same run.
# "-blocks": gather units for the blocks only (the root's own parameters gathered one by one, the default before
# the root became a unit), to price the root unit in the same run.
# "-gloo": the units' collectives over gloo's sockets, not shared memory (SHARDTENSOR_SHM_COLLECTIVES=0), to price
# the shared-memory channel in the same run.
# "-cpuadam": shardtensor.optim.CPUAdam with its defaults (speculative steps during backward) instead of AdamW.
# "zero3-floor": the work no ZeRO-3 step can skip, with no library around it (see _zero3_floor_step).
# Optional peers: the module each needs, and how to get it (the ranks would fail on import otherwise).
OPTIONAL = {"deepspeed": "deepspeed", "deepspeed-seq": "deepspeed"}
INSTALL_HINT = {"deepspeed": "DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install --no-build-isolation deepspeed==0.19.8 "
                             "(after torch and the [bench] extra; see benchmarks/README.md)"}
PERSIST_NUMEL = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
MMAP_THRESHOLD = "65536"
FLIGHT_RECORDER_ENTRIES = "0"  # see the module docstring


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The benchmark GPT (10.3M parameters), shared by every benchmark that compares against this one."""
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--block", type=int, default=128, help="sequence length T (Default: 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (Default: 4)")


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=CONFIGS)
    p.add_argument("--world", type=int, default=2, help="ranks per configuration (Default: 2)")
    add_model_args(p)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (Default: 2)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per round (Default: 4)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the configurations (Default: 3)")
    p.add_argument("--prefetch-bytes", type=int, default=None, help="shardtensor overlapped/auto budget "
                   "(Default: shard_module's own default)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--profile", default=None, choices=CONFIGS,
                   help="run only this config, cProfile rank 0's timed steps, write <out>_profile_<config>.txt")
    p.add_argument("--out", default=None, help="output prefix (Default: benchmarks/results/peers[_cuda])")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(ROOT, "benchmarks", "results", "peers" + ("_cuda" if args.device == "cuda" else ""))
    if args.profile:
        args.configs, args.repeats = [args.profile], 1
    return args


def missing_peers(configs: list[str]) -> dict[str, str]:
    """``{config: why it is skipped}`` for the optional peers whose package is not importable here."""
    return {c: f"{OPTIONAL[c]} is not installed: {INSTALL_HINT[OPTIONAL[c]]}" for c in configs
            if c in OPTIONAL and importlib.util.find_spec(OPTIONAL[c]) is None}


# ---------------------------------------------------------------------------------------------------- one rank
def _memory_mark(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def _memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    import psutil

    return psutil.Process().memory_info().rss


def _memory_peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _wrap(model: torch.nn.Module, config: str, args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The model under a wrapper that leaves the optimizer to the caller (every config but DeepSpeed's)."""
    if config == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (args.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if config == "local":
        return model
    if config == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if config in OPTIONAL:
        raise ValueError(f"{config} owns its optimizer: build it with _trainer(), not _wrap()")
    import shardtensor

    kwargs = {} if args.prefetch_bytes is None else {"prefetch_bytes": args.prefetch_bytes}
    if config.endswith("-persist"):  # biases and norm weights stay whole on every rank: no gathers for them
        kwargs["persist_numel"] = PERSIST_NUMEL
    shardtensor.set_divergence_check(not config.endswith("-unchecked"))
    mode = config.removeprefix("st-")
    if config.endswith("-blocks"):
        kwargs["units"] = [type(model.blocks[0])]
    if config.endswith("-gloo"):  # read when shard_module opens the channel; each config has its own processes
        os.environ["SHARDTENSOR_SHM_COLLECTIVES"] = "0"
    for suffix in ("-persist", "-unchecked", "-cpuadam", "-blocks", "-gloo"):
        mode = mode.removesuffix(suffix)
    return shardtensor.shard_module(model, gather=mode, **kwargs)


def _zero3_floor_step(model: torch.nn.Module, args: argparse.Namespace) -> Callable:
    """The least work any ZeRO-3 step does, with no library around it: the local model's forward and backward; the
    collectives ZeRO-3 cannot avoid, as FSDP2 buckets them (each block's parameters, and the rest's, all-gathered
    before the forward and again before the backward; their gradients flattened and reduce-scattered); AdamW on
    this rank's 1/world of them.  Nothing overlaps and nothing is copied into the parameters (the local model
    already holds them), so its step time is not a floor for wall time, but its CPU time is one here: gloo's
    copies cost CPU seconds whether or not they overlap compute.  It trains only the local model: its loss is the
    local run's and its memory means nothing."""
    import torch.distributed as dist

    world = dist.get_world_size()
    groups = [list(block.parameters()) for block in model.blocks]
    in_blocks = {id(p) for group in groups for p in group}
    groups.insert(0, [p for p in model.parameters() if id(p) not in in_blocks])
    buckets = []  # (parameters, numel, this rank's shard, the gathered full bucket, the flat gradient)
    for params in groups:
        numel = sum(p.numel() for p in params)
        per_rank = -(-numel // world)
        buckets.append((params, numel, torch.zeros(per_rank), torch.empty(per_rank * world),
                        torch.zeros(per_rank * world)))
    shards = [torch.nn.Parameter(torch.zeros(b[2].numel())) for b in buckets]
    opt = torch.optim.AdamW(shards, lr=args.lr, weight_decay=0.01)

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13's names
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def gather_all() -> None:
        for _, _, shard, full, _ in buckets:
            all_gather(full, shard)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        gather_all()
        loss = model(x, y)
        gather_all()
        loss.backward()
        for (params, numel, _, _, flat), shard in zip(buckets, shards):
            torch.cat([p.grad.reshape(-1) for p in params], out=flat[:numel])
            shard.grad = torch.empty_like(shard)
            reduce_scatter(shard.grad, flat)
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        return loss

    return step


def _deepspeed_config(config: str, batch: int) -> dict:
    zero = {"stage": 3}
    if config == "deepspeed-seq":
        zero["stage3_allgather_sequential"] = True
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 1 << 30}


def _trainer(model: torch.nn.Module, config: str, args: argparse.Namespace, device: torch.device,
             batch: int) -> tuple[torch.nn.Module, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """``(module, step)``: ``step(x, y)`` runs forward, backward, the AdamW step and zero_grad; returns the loss."""
    if config in ("deepspeed", "deepspeed-seq"):
        import deepspeed

        client = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client,
                                               config=_deepspeed_config(config, batch))

        def ds_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()  # the optimizer step and zero_grad
            return loss

        return engine, ds_step
    if config == "zero3-floor":
        return model, _zero3_floor_step(model, args)
    module = _wrap(model, config, args, device)
    if config.endswith("-cpuadam"):
        from shardtensor.optim import CPUAdam

        opt = CPUAdam(module.parameters(), lr=args.lr, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = module(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step.optimizer = opt  # the report reads CPUAdam's speculation counters from it
    return module, step


def _warm_up_optimizer() -> None:
    """Build AdamW once and step it on a throwaway layer, so the memory mark comes after what that does once per
    process: ``torch.optim.Optimizer.__init__`` imports ``torch._dynamo`` and its ~900 modules (about 95 MiB of
    RSS here), which every configuration would otherwise count as training memory."""
    layer = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, 4)).sum().backward()
    opt.step()


def _warm_up_config(config: str, args: argparse.Namespace, device: torch.device) -> None:
    """Two AdamW steps of a tiny GPT under ``config``, before the memory mark, so what each code path costs once
    per process is not counted as the model's memory: the pages of libtorch's code that a new path faults in,
    gloo's first collectives, the library's own caches.  Each configuration warms up its own paths."""
    from shardtensor.models import GPT, GPTConfig

    torch.manual_seed(0)
    tiny = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=args.heads, n_embd=8 * args.heads)
    model, step = _trainer(GPT(tiny).to(device), config, args, device, batch=2)
    idx = torch.randint(0, tiny.vocab_size, (2, tiny.block_size), device=device)
    for _ in range(2):
        step(idx, idx)
    del model, step
    gc.collect()


def _floor_step_peak(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                     world: int) -> int:
    """Peak of one more forward and backward of the ``local`` model in which every gradient, once accumulated, is
    swapped for a tensor of one rank's shard size: as a ZeRO-3 holds it (whole until its reduce-scatter, then a
    shard).  Resets the peak counter: call it after the run's own peak was read."""
    shards = []

    def to_shard(p: torch.Tensor) -> None:
        shards.append(torch.zeros(_shard_numel(p, world), dtype=p.dtype, device=p.device))
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(to_shard) for p in model.parameters()]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM (and ru_maxrss) to the current RSS
            f.write("5")
    model(x, y).backward()
    for h in handles:
        h.remove()
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _shard_numel(p: torch.Tensor, world: int) -> int:
    """Elements of one rank's dim-0 shard of ``p`` (rows rounded up, as every ZeRO-3 pads them)."""
    return -(-p.shape[0] // world) * p[0].numel() if p.dim() else 1


def run_rank(config: str, args: argparse.Namespace) -> dict:
    """One rank's run (the process group is up).  Returns this rank's figures."""
    import torch.distributed as dist

    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus

    # Every config imports its wrappers before the mark, so no config's growth includes library code.
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import shardtensor

    _warm_up_optimizer()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    corpus = synthetic_corpus(20_000, args.vocab, seed=0)
    gen = torch.Generator().manual_seed(1000 + rank)  # same batches on this rank for every config
    _warm_up_config(config, args, device)
    dist.barrier()

    base = _memory_mark(device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    # Parameters plus AdamW's two moments, whole and as one rank's dim-0 shard: what the floor swaps.
    state_full = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    state_shard = 3 * sum(_shard_numel(p, world) * p.element_size() for p in model.parameters())
    module, step_fn = _trainer(model, config, args, device, batch=args.batch)
    marks = {"after_wrap_mib": (_memory_now(device) - base) / 2**20}

    profiler = None
    losses, times, cpu_times, check_times = [], [], [], []
    for step in range(args.warmup + args.steps):
        x, y = get_batch(corpus, args.batch, args.block, gen)
        x, y = x.to(device), y.to(device)
        dist.barrier()
        if step == args.warmup and args.profile and rank == 0:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        checks_before = shardtensor.identity_check_stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        loss = step_fn(x, y)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        checks_after = shardtensor.identity_check_stats()
        check_times.append((checks_after["seconds"] - checks_before["seconds"],
                            checks_after["checks"] - checks_before["checks"]))
        losses.append(loss.item())
        if step == 0:
            marks["peak_after_step1_mib"] = (_memory_peak(device) - base) / 2**20
    if profiler is not None:
        profiler.disable()
    peak = _memory_peak(device)
    if config == "local":
        marks["floor_step_peak_mib"] = (_floor_step_peak(module, x, y, device, world) - base) / 2**20

    timed = slice(args.warmup, None)
    out = {
        "config": config,
        "rank": rank,
        "peak_mib": (peak - base) / 2**20,
        "base_mib": base / 2**20,
        "step_s": statistics.median(times[timed]),
        "cpu_s": statistics.median(cpu_times[timed]),
        # the cross-rank identity check inside those steps (shardtensor only): seconds and checks per step
        "identity_check_s": statistics.median(c[0] for c in check_times[timed]),
        "identity_checks": statistics.median(c[1] for c in check_times[timed]),
        **marks,
        "step_s_min": min(times[timed]),
        "step_times_s": times,
        "cpu_times_s": cpu_times,
        "losses": losses,
        "params": n_params,
        "state_full_mib": state_full / 2**20,
        "state_shard_mib": state_shard / 2**20,
        "mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "threads": torch.get_num_threads(),
    }
    if config.startswith("st-"):
        out["gather_stats"] = shardtensor.gather_stats(module)
    stats = getattr(getattr(step_fn, "optimizer", None), "stats", None)
    if stats is not None:  # CPUAdam: how many steps' speculation stood
        out["cpuadam_stats"] = dict(vars(stats))
    if profiler is not None:
        import io
        import pstats

        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def _worker(rank: int, world: int, port: int, config: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    threads = max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    backend = "nccl" if args.device == "cuda" else "gloo"
    try:
        if config in OPTIONAL:  # DeepSpeed sets up its own communication layer over the same torch group
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend)
            torch.set_num_threads(threads)  # the same threads for every config, whatever its import did
        else:
            dist.init_process_group(backend, rank=rank, world_size=world)
        return run_rank(config, args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(config: str, args: argparse.Namespace) -> list[dict]:
    """A fresh group of ``args.world`` processes for one configuration; their per-rank figures."""
    # Read at process start (glibc) or at group creation: they must be in the environment the ranks inherit.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    os.environ["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else DeepSpeed looks for a GPU and its CUDA ops
    for attempt in range(RETRIES + 1):
        try:
            return spawn_ranks(_worker, args.world, config, args)  # rank order; a failed rank raises RankFailed
        except RankFailed as e:
            if attempt == RETRIES:
                raise SystemExit(f"{config}: {e}") from None
            # DeepSpeed 0.19.8's CPU comm threads now and then abort a rank ("terminate called without an active
            # exception"): the round is run again, said here, and counted in the results.
            print(f"RETRY {config}: {e}", flush=True)
            RETRIED[config] = RETRIED.get(config, 0) + 1


RETRIES = 1
RETRIED: dict[str, int] = {}  # configuration -> rounds run again after a rank failed


def round_order(configs: list[str], round_index: int) -> list[str]:
    """Round ``i`` runs the list rotated by ``i``: configurations alternate and none always goes first."""
    k = round_index % len(configs)
    return configs[k:] + configs[:k]


def main(argv=None) -> dict:
    import peers_report

    args = _parse(argv)
    shown = sys.argv[1:] if argv is None else list(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_peers.py"] + shown)
    skipped = missing_peers(args.configs)
    for config, why in skipped.items():
        print(f"SKIPPED {config}: {why}", flush=True)
    configs = [c for c in args.configs if c not in skipped]
    if not configs:
        raise SystemExit("nothing to run: every configuration asked for was skipped")
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, list[list[dict]]] = {c: [] for c in configs}
    for rep in range(args.repeats):
        for config in round_order(configs, rep):
            t = time.perf_counter()
            rows = spawn(config, args)
            runs[config].append(rows)
            print(f"[{rep + 1}/{args.repeats}] {config:<14} " + "  ".join(
                f"rank {r['rank']}: {r['peak_mib']:6.1f} MiB {r['step_s']:.3f} s/step {r['cpu_s']:.3f} cpu-s/step "
                f"identity check {r['identity_check_s'] * 1e3:.1f} ms/step ({r['identity_checks']:.0f})"
                for r in rows) + f"  (loss {rows[0]['losses'][0]:.6f} -> {rows[0]['losses'][-1]:.6f}, "
                f"{time.perf_counter() - t:.0f} s)", flush=True)

    if args.profile:
        text = runs[args.profile][0][0]["profile"]
        path = f"{args.out}_profile_{args.profile}.txt"
        with open(path, "w") as f:
            f.write(f"# {command}\n# rank 0, {args.steps} timed steps, cProfile (adds overhead)\n{text}")
        print(text[:6000])
        print(f"wrote {path}")
        return {}
    args.rounds_run_again = RETRIED
    return peers_report.write(runs, args, command, skipped, load_before, time.perf_counter() - started)


if __name__ == "__main__":
    main()
