"""Where each configuration's memory goes within a step: per-step RSS growth at the step's start and the peak of
its forward, backward and optimizer phases (the kernel's high-water mark, reset between phases), per rank.

It backs two statements in README and ``bench_peers.py``: sharded sequential mode grows by the same amount as
the bare model within forward and backward (so what is left above the ZeRO-3 floor is not ours), and c10d's
flight recorder grows a run's RSS step after step until its ring of collectives is full (``--flight-recorder``
on vs off).  CPU only (``/proc/self/clear_refs``); same model flags as ``bench_peers.py``.

    python benchmarks/bench_memory_phases.py                              # local, st-sequential, fsdp2; recorder off
    python benchmarks/bench_memory_phases.py --flight-recorder --steps 12 --out benchmarks/results/memory_phases_fr.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_peers as bench  # noqa: E402  (the same wrappers, warm-ups and model flags)

from shardtensor.launch import run_or_exit  # noqa: E402


def _high_water_mib_and_reset() -> float:
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return hwm / 1024


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def run_rank(config: str, args: argparse.Namespace, steps: int) -> dict:
    import torch.distributed as dist

    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus

    import torch.distributed.fsdp  # noqa: F401
    import shardtensor  # noqa: F401

    device = torch.device("cpu")
    bench._warm_up_optimizer()
    bench._warm_up_config(config, args, device)
    corpus = synthetic_corpus(20_000, args.vocab, seed=0)
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    dist.barrier()
    base = _rss_mib()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim)
    model = bench._wrap(GPT(cfg), config, args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rows = []
    for _ in range(steps):
        x, y = get_batch(corpus, args.batch, args.block, gen)
        dist.barrier()
        _high_water_mib_and_reset()
        start = _rss_mib() - base
        loss = model(x, y)
        forward = _high_water_mib_and_reset() - base
        loss.backward()
        backward = _high_water_mib_and_reset() - base
        opt.step()
        opt.zero_grad(set_to_none=True)
        optimizer = _high_water_mib_and_reset() - base
        rows.append({"start": start, "forward_peak": forward, "backward_peak": backward,
                     "optimizer_peak": optimizer, "backward_peak_above_start": backward - start})
    return {"config": config, "rank": dist.get_rank(), "steps": rows}


def _worker(rank: int, world: int, port: int, config: str, args: argparse.Namespace, steps: int) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return run_rank(config, args, steps)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["local", "st-sequential", "fsdp2"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--flight-recorder", action="store_true", help="leave c10d's flight recorder on (torch default)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "memory_phases.json"))
    ours, rest = p.parse_known_args(argv)
    args = bench._parse(rest)  # model flags: --vocab --dim --layers --heads --block --batch --world ...
    os.environ["MALLOC_MMAP_THRESHOLD_"] = bench.MMAP_THRESHOLD
    if ours.flight_recorder:
        os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    else:
        os.environ["TORCH_FR_BUFFER_SIZE"] = bench.FLIGHT_RECORDER_ENTRIES
    result = {"command": "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)]
                                               + (sys.argv[1:] if argv is None else list(argv))),
              "flight_recorder": ours.flight_recorder, "runs": []}
    print("MiB above the mark, rank 0: start of step / forward, backward, optimizer peaks / backward peak - start")
    for config in ours.configs:
        rows = run_or_exit(_worker, args.world, config, args, ours.steps)  # a failed rank: its error, exit code 1
        result["runs"].extend(rows)
        for i, s in enumerate(rows[0]["steps"]):
            print(f"{config:<14} step {i:2d}: start {s['start']:6.1f}  fwd {s['forward_peak']:6.1f}  "
                  f"bwd {s['backward_peak']:6.1f}  opt {s['optimizer_peak']:6.1f}  "
                  f"bwd-start {s['backward_peak_above_start']:5.1f}", flush=True)
    with open(ours.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {ours.out}")
    return result


if __name__ == "__main__":
    main()
