"""torch.compile row: compiled sharded vs eager sharded vs FSDP2 with per-block compile, same GPT, same run.

Configurations (each in a fresh group of ``--world`` gloo processes, CPU):
  - ``st-eager``:       ``shard_module(model)`` (overlapped gathers), eager;
  - ``st-eager-seq``:   ``shard_module(model, gather="sequential")``, eager;
  - ``st-compiled``:    ``torch.compile(shard_module(model), fullgraph=True)``: one graph, a gather node per gather
    unit (each block, the root) in the forward and again in the backward, on gloo the eager unit collective as a
    custom op (shared memory where the ranks share a host: see shardtensor/_traced.py), and a reduce-scatter node
    per parameter in the backward (shardtensor/_traced_grads.py);
  - ``st-compiled-seq``: the same with ``gather="sequential"``: a gather node per parameter read (the lowest peak);
  - ``st-compiled-bucketed`` (not in the default set): ``st-compiled`` with inductor's all-gather bucketing and
    compute/comm reordering on (``bucket_all_gathers_fx="all"``, ``reorder_for_compute_comm_overlap``: they act
    on functional collectives, which gloo graphs do not have);
  - ``fsdp2-compiled``: ``fully_shard`` per block and on the root, each block ``torch.compile``d (FSDP2's recipe);
  - ``st-compiled-step`` / ``fsdp2-compiled-step`` / ``local-compiled-step``: the same, with the optimizer step
    compiled too (``torch.compile(opt.step)``, PyTorch's recipe for a compiled optimizer; for shardtensor see
    [Note: a compiled optimizer step] in shardtensor/_dispatch/traced.py);
  - ``local-eager`` / ``local-compiled``: the unsharded model on every rank, no collective at all: the floor, and
    what compiling gains on the compute alone (on a CPU whose step is mostly matmuls: little);
  - ``zero3-floor`` / ``zero3-floor-compiled`` (not in the default set): the local model, eager or compiled, plus
    the collectives no ZeRO-3 step can skip and AdamW on this rank's share (``bench_peers._zero3_floor_step``):
    what a compiled sharded step could reach if the library cost nothing and nothing overlapped.

Step time is the median of the timed steps (after ``--warmup`` steps, which include compilation), wall time of the
slowest rank and CPU seconds summed over the ranks (each process, its gloo threads included: the steadier figure
on a shared machine); peak is the
process's peak RSS growth over the mark taken before the model is built (CPU: includes compiler memory); step peak
is the RSS high-water mark of one more warm step over its start (the step's own tensors: see ``_step_peak_bytes``).

    python benchmarks/bench_compile.py [--dim 256 --layers 2 ...]   # writes benchmarks/results/compile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers import _memory_mark, _memory_peak, _zero3_floor_step, add_model_args  # noqa: E402
from shardtensor.launch import spawn_ranks  # noqa: E402

CONFIGS = ["st-eager", "st-eager-seq", "st-compiled", "st-compiled-seq", "fsdp2-compiled", "local-eager",
           "local-compiled"]
OPTIONAL = ["zero3-floor", "zero3-floor-compiled", "st-compiled-bucketed", "st-compiled-step", "fsdp2-compiled-step",
            "local-compiled-step"]


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS + OPTIONAL)
    p.add_argument("--world", type=int, default=2)
    add_model_args(p)  # the GPT of bench_peers.py
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation happens here)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the configurations")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "compile.json"))
    return p.parse_args(argv)


def _build(config: str, model: torch.nn.Module, world: int):
    """(module whose parameters the optimizer steps, callable that runs the forward)."""
    import shardtensor

    if config.startswith("local-") or config.startswith("zero3-floor"):
        return model, torch.compile(model) if "-compiled" in config else model
    if config.startswith("st-"):
        shardtensor.shard_module(model, gather="sequential" if config.endswith("-seq") else "overlapped")
        if config == "st-compiled-bucketed":
            import torch._inductor.config as inductor_config

            inductor_config.bucket_all_gathers_fx = "all"
            inductor_config.reorder_for_compute_comm_overlap = True
        run = torch.compile(model, fullgraph=True) if config.startswith("st-compiled") else model
        return model, run
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh)
        model.blocks[i] = torch.compile(block)
    fully_shard(model, mesh=mesh)
    return model, model


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _step_peak_bytes(step) -> int:
    """Peak RSS growth during one warm step (compiled code and compiler memory already resident): the Linux
    high-water mark reset just before (``/proc/self/clear_refs``), read after.  With ``MALLOC_MMAP_THRESHOLD_``
    small, every tensor of the step is its own mapping, so this is the step's transient tensor memory
    (gathered weights, activations, gradients) rather than whatever the compiler kept."""
    import psutil

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = psutil.Process().memory_info().rss
    step()
    return _vm_hwm() - before


def _worker(rank: int, world: int, port: int, config: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        corpus = synthetic_corpus(20_000, args.vocab, seed=0)
        gen = torch.Generator().manual_seed(1000 + rank)
        base = _memory_mark(torch.device("cpu"))
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers,
                              n_head=args.heads, n_embd=args.dim))
        model, run = _build(config, model, world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        opt_step = torch.compile(opt.step) if config.endswith("-step") else opt.step
        # the floor steps its own AdamW on this rank's share, around the (compiled) local model
        floor = _zero3_floor_step(run, argparse.Namespace(lr=1e-3)) if config.startswith("zero3-floor") else None
        times, cpu_times, losses = [], [], []

        def step() -> None:
            x, y = get_batch(corpus, args.batch, args.block, gen)
            dist.barrier()
            start, cpu_start = time.perf_counter(), time.process_time()
            if floor is not None:
                loss = floor(x, y)
            else:
                loss = run(x, y)
                loss.backward()
                opt_step()
                opt.zero_grad()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)  # this rank's process, gloo's threads included
            losses.append(loss.item())

        for _ in range(args.warmup + args.steps):
            step()
        step_peak = _step_peak_bytes(step)
        return {"config": config, "rank": rank, "step_s": statistics.median(times[args.warmup:-1]),
                "cpu_s": statistics.median(cpu_times[args.warmup:-1]),
                "first_steps_s": times[: args.warmup], "losses": losses,
                "peak_mib": (_memory_peak(torch.device("cpu")) - base) / 2**20, "step_peak_mib": step_peak / 2**20}
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    args = _parse(argv)
    rows = {}  # this run's rows only: ratios between runs on this shared machine mean nothing
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by each rank's allocator at start
    rounds: dict = {config: [] for config in args.configs}
    loads = []
    for round_index in range(args.repeats):  # interleaved: a load change on the shared machine hits every config
        order = args.configs[round_index % len(args.configs):] + args.configs[:round_index % len(args.configs)]
        for config in order:
            loads.append(os.getloadavg()[0])
            ranks = spawn_ranks(_worker, args.world, config, args, timeout=1800)
            rounds[config].append({
                "step_s": max(r["step_s"] for r in ranks), "cpu_s": sum(r["cpu_s"] for r in ranks),
                "peak_mib": max(r["peak_mib"] for r in ranks),
                "warmup_s": max(sum(r["first_steps_s"]) for r in ranks), "losses_rank0": ranks[0]["losses"],
                "step_peak_mib": max(r["step_peak_mib"] for r in ranks)})
            last = rounds[config][-1]
            print(f"round {round_index}: {config:20s} step {last['step_s'] * 1e3:8.1f} ms  cpu {last['cpu_s']:6.3f} s  peak {last['peak_mib']:7.1f}"
                  f" MiB  step peak {last['step_peak_mib']:6.1f} MiB  warmup+compile {last['warmup_s']:6.1f} s",
                  flush=True)
    for config, runs in rounds.items():
        steps = [r["step_s"] for r in runs]
        cpus = [r["cpu_s"] for r in runs]
        rows[config] = {"step_s": statistics.median(steps), "step_s_rounds": steps,
                        "cpu_s": statistics.median(cpus), "cpu_s_rounds": cpus,
                        "peak_mib": statistics.median(r["peak_mib"] for r in runs),
                        "step_peak_mib": statistics.median(r["step_peak_mib"] for r in runs),
                        "warmup_s": statistics.median(r["warmup_s"] for r in runs),
                        "losses_rank0": runs[0]["losses_rank0"]}
    if "st-eager" in rows:
        eager, eager_cpu = rows["st-eager"]["step_s"], rows["st-eager"].get("cpu_s")
        for config, row in rows.items():
            cpu = (f"  cpu {row['cpu_s']:.3f} s ({row['cpu_s'] / eager_cpu:.2f}x)"
                   if eager_cpu and row.get("cpu_s") else "")
            print(f"{config:20s} median step {row['step_s'] * 1e3:8.1f} ms ({row['step_s'] / eager:.2f}x st-eager; rounds "
                  + ", ".join(f"{t * 1e3:.0f}" for t in row.get("step_s_rounds", [row["step_s"]]))
                  + f"){cpu}  step peak {row['step_peak_mib']:6.1f} MiB")
    result = {"args": vars(args), "load_avg_at_starts": loads, "load_avg_end": os.getloadavg(), "rows": rows,
              "command": "python benchmarks/bench_compile.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
