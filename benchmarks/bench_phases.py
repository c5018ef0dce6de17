"""Where a step's time goes, by phase: forward, backward, optimizer step, for DDP, the bare model and shardtensor.

``bench_peers.py`` times whole steps; this splits each step into its three phases and counts, per phase, wall
seconds, CPU seconds of the rank's process and minor page faults (``getrusage``), so a difference between two
configurations can be placed: the forward (gathers), the backward (gradient reductions) or the optimizer (on a
shard, or on the whole model).  Same GPT, batches, world size and environment as ``bench_peers.py``
(``MALLOC_MMAP_THRESHOLD_=65536`` unless set otherwise, flight recorder off, one thread per rank); interleaved
rounds, medians over rounds of the mean over ranks.

Why page faults: with ``MALLOC_MMAP_THRESHOLD_=65536`` (the memory benchmarks' setting: freed tensors go back to
the OS, so RSS is the peak of live tensors) every fresh tensor over 64 KiB faults its pages in, which costs every
configuration a share of its step; ``MALLOC_MMAP_THRESHOLD_=33554432 python benchmarks/bench_phases.py`` times the
same steps with glibc reusing freed memory instead.

    python benchmarks/bench_phases.py                                  # ddp, local, st-overlapped; 3 rounds
    python benchmarks/bench_phases.py --configs ddp st-overlapped st-sequential --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_peers  # noqa: E402
from shardtensor.launch import spawn_ranks  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
CONFIGS = ["ddp", "local", "st-overlapped", "st-sequential", "fsdp2"]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _run_rank(config: str, args: argparse.Namespace) -> dict:
    """One rank: ``{phase: [wall s, cpu s, minor faults]}``, medians over the timed steps."""
    import torch.distributed as dist

    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus

    bench_peers._warm_up_optimizer()
    rank = dist.get_rank()
    corpus = synthetic_corpus(20_000, args.vocab, seed=0)
    gen = torch.Generator().manual_seed(1000 + rank)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim)
    module = bench_peers._wrap(GPT(cfg), config, args, torch.device("cpu"))
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)
    rows = []
    for step in range(args.warmup + args.steps):
        x, y = get_batch(corpus, args.batch, args.block, gen)
        dist.barrier()
        marks = [(time.perf_counter(), time.process_time(), _faults())]
        loss = module(x, y)
        marks.append((time.perf_counter(), time.process_time(), _faults()))
        loss.backward()
        marks.append((time.perf_counter(), time.process_time(), _faults()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append((time.perf_counter(), time.process_time(), _faults()))
        if step >= args.warmup:
            rows.append([[b[k] - a[k] for k in range(3)] for a, b in zip(marks, marks[1:])])
    return {phase: [statistics.median(r[i][k] for r in rows) for k in range(3)] for i, phase in enumerate(PHASES)}


def _worker(rank: int, world: int, port: int, config: str, args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return _run_rank(config, args)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=CONFIGS[:3], choices=CONFIGS)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (Default: 10)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "phases.json"))
    ours = p.parse_args(argv)
    args = bench_peers._parse(["--steps", str(ours.steps)])  # the benchmark GPT and its settings
    args.warmup = 3
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", bench_peers.MMAP_THRESHOLD)
    os.environ["TORCH_FR_BUFFER_SIZE"] = "0"
    command = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/bench_phases.py"] + (
        sys.argv[1:] if argv is None else list(argv)))
    runs: dict[str, list] = {c: [] for c in ours.configs}
    for r in range(ours.rounds):
        for config in bench_peers.round_order(ours.configs, r):
            ranks = spawn_ranks(_worker, args.world, config, args)
            runs[config].append({ph: [statistics.fmean(rk[ph][k] for rk in ranks) for k in range(3)] for ph in PHASES})
            print(f"[{r + 1}/{ours.rounds}] {config}: " + "  ".join(
                f"{ph} {v[0] * 1e3:.1f} ms / {v[1] * 1e3:.1f} cpu-ms / {v[2] / 1e3:.1f}k faults"
                for ph, v in runs[config][-1].items()), flush=True)
    table = {c: {ph: [statistics.median(run[ph][k] for run in runs[c]) for k in range(3)] for ph in PHASES}
             for c in ours.configs}
    print(f"\n{command}  (MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}; per rank, median over "
          f"{ours.rounds} rounds of the mean over ranks)\n")
    print("| config | " + " | ".join(f"{ph} ms" for ph in PHASES) + " | step ms | " +
          " | ".join(f"{ph} cpu-ms" for ph in PHASES) + " | step cpu-ms | " +
          " | ".join(f"{ph} faults (k)" for ph in PHASES) + " |")
    print("|---|" + "---:|" * 11)
    for c, row in table.items():
        walls, cpus, faults = ([row[ph][k] for ph in PHASES] for k in range(3))
        print(f"| {c} | " + " | ".join(f"{v * 1e3:.1f}" for v in walls) + f" | {sum(walls) * 1e3:.1f} | " +
              " | ".join(f"{v * 1e3:.1f}" for v in cpus) + f" | {sum(cpus) * 1e3:.1f} | " +
              " | ".join(f"{v / 1e3:.1f}" for v in faults) + " |")
    result = {"command": command, "mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"], "world": args.world,
              "load_after": os.getloadavg(), "medians": table, "rounds": runs}
    os.makedirs(os.path.dirname(ours.out), exist_ok=True)
    with open(ours.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {ours.out}")
    return result


if __name__ == "__main__":
    main()
