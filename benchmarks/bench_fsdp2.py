"""shardtensor beside FSDP2 and DDP: peak memory per rank and median step time on one model (issue 5).

Every configuration trains the same GPT (``shardtensor.models``) on the same batches with AdamW, at the same world
size, in its own freshly spawned group of ranks (gloo on the CPU, a free port each), so peaks never mix:

  - ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every transformer block, then on the root
  - ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (the unsharded reference)
  - ``local``: the bare model, every rank training alone (no collectives).  It prices the floor: its peak with
    the full parameters and AdamW state replaced by one rank's shards of them is the least any ZeRO-3 that keeps
    the same activations can reach (the "ZeRO-3 floor" line)
  - ``st-sequential`` / ``st-overlapped`` / ``st-auto``: ``shardtensor.shard_module(model, gather=...)``

CPU memory is the growth of each rank's peak resident set: ``ru_maxrss`` at the end minus the psutil RSS just
before the model is built (after the libraries are imported and AdamW has been built once: its first
construction imports ``torch._dynamo``, ~95 MiB, which is no configuration's memory; and after two steps of a
tiny GPT under the same configuration, so that code paths' one-time costs are not either: libtorch code pages
faulted in, gloo's first collectives), with ``MALLOC_MMAP_THRESHOLD_=65536`` in every worker's
environment from its start (so freed tensors go back to the OS and the peak is the peak of live tensors, not of
glibc's arena) and ``TORCH_FR_BUFFER_SIZE=0`` (c10d's flight recorder keeps the last 2000 collectives: a config
that issues more collectives fills it within a short run and looks up to 2.5 MiB bigger, while in a long run
every config holds a full ring; ``bench_memory_phases.py --flight-recorder`` shows it).  With
``--device cuda`` it is ``torch.cuda.max_memory_allocated`` minus the allocation before the model (nccl; that path
is untested: it was written on a machine without a GPU).  Step time is the median over the steps after warm-up;
ranks meet at a barrier before each step, outside the timed region.

    python benchmarks/bench_fsdp2.py                            # the issue's config: ~2-4 min on 2 CPU cores
    python benchmarks/bench_fsdp2.py --configs fsdp2 st-sequential --steps 20
    python benchmarks/bench_fsdp2.py --profile st-overlapped    # cProfile of rank 0's timed steps, to a .txt
    python benchmarks/bench_fsdp2.py --device cuda              # untested

Writes ``<out>.json`` (command line, config, every rank's figures), ``<out>.png`` (memory vs step time) and
``<out>_table.md``; ``<out>`` is ``benchmarks/results/fsdp2`` (``fsdp2_cuda`` with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import shlex
import statistics
import sys
import time

import torch

from shardtensor.launch import run_or_exit

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

CONFIGS = ["fsdp2", "ddp", "local", "st-sequential", "st-overlapped", "st-auto", "st-overlapped-persist"]
PERSIST_NUMEL = 100_000  # DeepSpeed's stage3_param_persistence_threshold default
MMAP_THRESHOLD = "65536"
FLIGHT_RECORDER_ENTRIES = "0"  # see the module docstring
TARGET_MEMORY = 0.9  # shardtensor sequential peak <= 0.9x FSDP2's
TARGET_TIME = 1.0  # shardtensor overlapped median step <= 1.0x FSDP2's


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    p.add_argument("--world", type=int, default=2, help="ranks per configuration (Default: 2)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--block", type=int, default=128, help="sequence length T (Default: 128)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (Default: 4)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (Default: 3)")
    p.add_argument("--steps", type=int, default=12, help="timed steps (Default: 12)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the configuration list this many times, round robin; report medians (Default: 1)")
    p.add_argument("--prefetch-bytes", type=int, default=None, help="shardtensor overlapped/auto budget "
                   "(Default: shard_module's own default)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--profile", default=None, choices=CONFIGS,
                   help="run only this config, cProfile rank 0's timed steps, write <out>_profile_<config>.txt")
    p.add_argument("--out", default=None, help="output prefix (Default: benchmarks/results/fsdp2[_cuda])")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(ROOT, "benchmarks", "results", "fsdp2" + ("_cuda" if args.device == "cuda" else ""))
    if args.profile:
        args.configs = [args.profile]
    return args


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
    import shardtensor

    kwargs = {} if args.prefetch_bytes is None else {"prefetch_bytes": args.prefetch_bytes}
    if config.endswith("-persist"):  # biases and norm weights stay whole on every rank: no gathers for them
        kwargs["persist_numel"] = PERSIST_NUMEL
    return shardtensor.shard_module(model, gather=config.removeprefix("st-").removesuffix("-persist"), **kwargs)


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
    model = _wrap(GPT(tiny).to(device), config, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    idx = torch.randint(0, tiny.vocab_size, (2, tiny.block_size), device=device)
    for _ in range(2):
        model(idx, idx).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    del model, opt
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

    # Every config imports every wrapper before the mark, so no config's growth includes library code.
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import shardtensor  # noqa: F401

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
    model = _wrap(model, config, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    marks = {"after_wrap_mib": (_memory_now(device) - base) / 2**20}

    profiler = None
    losses, times = [], []
    for step in range(args.warmup + args.steps):
        x, y = get_batch(corpus, args.batch, args.block, gen)
        x, y = x.to(device), y.to(device)
        dist.barrier()
        if step == args.warmup and args.profile and rank == 0:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        start = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if step == 0:
            marks["peak_after_step1_mib"] = (_memory_peak(device) - base) / 2**20
    if profiler is not None:
        profiler.disable()
    peak = _memory_peak(device)
    if config == "local":
        marks["floor_step_peak_mib"] = (_floor_step_peak(model, x, y, device, world) - base) / 2**20

    out = {
        "config": config,
        "rank": rank,
        "peak_mib": (peak - base) / 2**20,
        "base_mib": base / 2**20,
        "step_s": statistics.median(times[args.warmup:]),
        **marks,
        "step_s_min": min(times[args.warmup:]),
        "step_times_s": times,
        "losses": losses,
        "params": n_params,
        "state_full_mib": state_full / 2**20,
        "state_shard_mib": state_shard / 2**20,
        "mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "threads": torch.get_num_threads(),
    }
    if config.startswith("st-"):
        import shardtensor

        out["gather_stats"] = shardtensor.gather_stats(model)
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

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank, world_size=world)
    try:
        return run_rank(config, args)
    finally:
        dist.destroy_process_group()


def spawn(config: str, args: argparse.Namespace) -> list[dict]:
    """A fresh group of ``args.world`` processes for one configuration; their per-rank figures."""
    # glibc reads it when the process starts: it must be in the environment the spawned ranks inherit.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    os.environ["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES  # read when the process group is created
    return run_or_exit(_worker, args.world, config, args)  # a failed rank: its traceback, exit code 1


# ---------------------------------------------------------------------------------------------------- report
def summarize(runs: dict[str, list[list[dict]]], world: int) -> list[dict]:
    """Per (config, rank): median over repeats of the peak and of the median step; ratios to FSDP2's same rank."""
    rows = []
    for config, repeats in runs.items():
        for rank in range(world):
            peaks = [rep[rank]["peak_mib"] for rep in repeats]
            steps = [rep[rank]["step_s"] for rep in repeats]
            rows.append({"config": config, "rank": rank, "peak_mib": statistics.median(peaks),
                         "step_s": statistics.median(steps),
                         "step_s_min": min(rep[rank]["step_s_min"] for rep in repeats),
                         "state_full_mib": repeats[0][rank]["state_full_mib"],
                         "state_shard_mib": repeats[0][rank]["state_shard_mib"],
                         "floor_step_peak_mib": statistics.median(rep[rank].get("floor_step_peak_mib", math.nan)
                                                                  for rep in repeats)})
    ref = {r["rank"]: r for r in rows if r["config"] == "fsdp2"}
    for r in rows:
        if r["rank"] in ref:
            r["mem_vs_fsdp2"] = r["peak_mib"] / ref[r["rank"]]["peak_mib"]
            r["time_vs_fsdp2"] = r["step_s"] / ref[r["rank"]]["step_s"]
            r["min_time_vs_fsdp2"] = r["step_s_min"] / ref[r["rank"]]["step_s_min"]
    return rows


def per_config(rows: list[dict]) -> dict[str, dict]:
    """Worst rank's peak and the mean of the ranks' median steps (ranks wait on each other's collectives)."""
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["config"], []).append(r)
    return {c: {"peak_mib": max(x["peak_mib"] for x in rs), "step_s": statistics.mean(x["step_s"] for x in rs),
                "state_full_mib": rs[0]["state_full_mib"], "state_shard_mib": rs[0]["state_shard_mib"],
                "floor_step_peak_mib": max(x["floor_step_peak_mib"] for x in rs)}
            for c, rs in out.items()}


def zero3_floor_mib(summary: dict[str, dict]) -> float | None:
    """The peak of the ``local`` model's forward and backward with each gradient swapped for a shard-sized one as
    it arrives, its whole parameters and AdamW moments swapped for one rank's shards: the activations, the loss's
    transients, one whole gradient, the sharded gradients and the runtime stay, and no ZeRO-3 that keeps the
    activations avoids them (it also holds a gathered parameter per op, which this leaves out)."""
    local = summary.get("local")
    if local is None or math.isnan(local["floor_step_peak_mib"]):
        return None
    return local["floor_step_peak_mib"] - local["state_full_mib"] + local["state_shard_mib"]


def markdown_table(rows: list[dict]) -> str:
    lines = ["| config | rank | peak MiB | x FSDP2 | median s/step | x FSDP2 | min s/step | x FSDP2 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mem = f"{r['mem_vs_fsdp2']:.2f}" if "mem_vs_fsdp2" in r else "-"
        tim = f"{r['time_vs_fsdp2']:.2f}" if "time_vs_fsdp2" in r else "-"
        tmin = f"{r['min_time_vs_fsdp2']:.2f}" if "min_time_vs_fsdp2" in r else "-"
        lines.append(f"| {r['config']} | {r['rank']} | {r['peak_mib']:.1f} | {mem} | {r['step_s']:.3f} | {tim} "
                     f"| {r['step_s_min']:.3f} | {tmin} |")
    return "\n".join(lines)


def acceptance(summary: dict[str, dict]) -> list[str]:
    out = []
    ref = summary.get("fsdp2")
    if ref is None:
        return out
    floor = zero3_floor_mib(summary)
    if floor is not None:
        out.append(f"ZeRO-3 floor (local forward+backward peak, gradients sharded on arrival, parameters and "
                   f"AdamW state swapped for shards) = {floor:.1f} MiB = "
                   f"{floor / ref['peak_mib']:.3f}x FSDP2")
    if "st-sequential" in summary:
        seq = summary["st-sequential"]["peak_mib"]
        ratio = seq / ref["peak_mib"]
        above = "" if floor is None else f"; {seq - floor:+.1f} MiB from the floor"
        out.append(f"st-sequential peak memory = {ratio:.3f}x FSDP2 (target <= {TARGET_MEMORY}x): "
                   f"{'MET' if ratio <= TARGET_MEMORY else 'NOT MET'}{above}")
    for name in ("st-overlapped", "st-overlapped-persist"):
        if name in summary:
            ratio = summary[name]["step_s"] / ref["step_s"]
            out.append(f"{name} median step = {ratio:.2f}x FSDP2 (target <= {TARGET_TIME}x): "
                       f"{'MET' if ratio <= TARGET_TIME else 'NOT MET'}")
    return out


def plot(summary: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for config, s in summary.items():
        color = "tab:red" if config == "fsdp2" else "tab:gray" if config == "ddp" else "tab:blue"
        ax.scatter(s["step_s"], s["peak_mib"], color=color, s=40, zorder=3)
        ax.annotate(config, (s["step_s"], s["peak_mib"]), textcoords="offset points", xytext=(6, 4), fontsize=9)
    if "fsdp2" in summary:
        ref = summary["fsdp2"]
        ax.axhline(TARGET_MEMORY * ref["peak_mib"], color="tab:red", ls="--", lw=0.8,
                   label=f"{TARGET_MEMORY}x FSDP2 memory")
        ax.axvline(TARGET_TIME * ref["step_s"], color="tab:red", ls=":", lw=0.8, label=f"{TARGET_TIME}x FSDP2 time")
        ax.legend(fontsize=8, loc="best")
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel("peak memory per rank, worst rank (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = _parse(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    started = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, list[list[dict]]] = {c: [] for c in args.configs}
    for rep in range(args.repeats):
        for config in args.configs:
            t = time.perf_counter()
            rows = spawn(config, args)
            runs[config].append(rows)
            print(f"[{rep + 1}/{args.repeats}] {config:<14} " + "  ".join(
                f"rank {r['rank']}: {r['peak_mib']:6.1f} MiB (wrap {r['after_wrap_mib']:.0f}, step 1 "
                f"{r['peak_after_step1_mib']:.0f}) {r['step_s']:.3f} s/step" for r in rows)
                + f"  (loss {rows[0]['losses'][0]:.3f} -> {rows[0]['losses'][-1]:.3f}, {time.perf_counter() - t:.0f} s)",
                flush=True)

    if args.profile:
        text = runs[args.profile][0][0]["profile"]
        path = f"{args.out}_profile_{args.profile}.txt"
        with open(path, "w") as f:
            f.write(f"# {command}\n# rank 0, {args.steps} timed steps, cProfile (adds overhead)\n{text}")
        print(text[:6000])
        print(f"wrote {path}")
        return {}

    rows = summarize(runs, args.world)
    summary = per_config(rows)
    table = markdown_table(rows)
    checks = acceptance(summary)
    # Same seed and same batches: the first loss must agree across configs (else they did not train the same thing).
    first_losses = {c: reps[0][0]["losses"][0] for c, reps in runs.items()}
    cfg = {k: getattr(args, k) for k in ("world", "vocab", "dim", "layers", "heads", "block", "batch", "lr",
                                          "warmup", "steps", "repeats", "prefetch_bytes", "device")}
    params = next(iter(runs.values()))[0][0]["params"]
    title = (f"GPT {params / 1e6:.1f}M params (V={args.vocab}, d={args.dim}, L={args.layers}, T={args.block}), "
             f"batch {args.batch}/rank, AdamW, {args.world} ranks, {args.device}")
    elapsed = time.perf_counter() - started

    print()
    print(title)
    print(table)
    print()
    for line in checks:
        print(line)
    print(f"first-step loss per config: " + ", ".join(f"{c}={v:.4f}" for c, v in first_losses.items()))
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"{elapsed:.0f} s in all")

    result = {
        "command": command,
        "argv": sys.argv,
        "config": cfg,
        "model_params": params,
        "env": {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "TORCH_FR_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES},
        "memory_metric": ("torch.cuda.max_memory_allocated - memory_allocated before the model" if args.device == "cuda"
                          else "ru_maxrss*1024 at the end - psutil rss before the model, per rank"),
        "time_metric": f"median of {args.steps} steps after {args.warmup} warm-up (forward, backward, AdamW step, "
                       "zero_grad; barrier before each step, untimed)",
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
                    "cpu_count": os.cpu_count(), "threads_per_rank": max(1, (os.cpu_count() or 1) // args.world),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "table": rows,
        "per_config": summary,
        "acceptance": checks,
        "first_step_loss": first_losses,
        "elapsed_s": elapsed,
        "runs": {c: [[{k: v for k, v in r.items() if k != "profile"} for r in rep] for rep in reps]
                 for c, reps in runs.items()},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(f"{args.out}_table.md", "w") as f:
        f.write(f"{title}\n\n`{command}`\n\n{table}\n\n" + "".join(f"- {c}\n" for c in checks)
                + f"\nload average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} "
                  f"on {os.cpu_count()} cores\n")
    plot(summary, f"{args.out}.png", title)
    print(f"wrote {args.out}.json, {args.out}.png, {args.out}_table.md")
    return result


if __name__ == "__main__":
    main()
