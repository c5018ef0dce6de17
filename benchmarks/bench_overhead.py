"""Per-op overhead of sharding: at world size 1, a ``shard_module`` model's training step vs the plain model's.

At world size 1 every gather returns the local tensor itself and every reduce is a no-op, so the difference is
what the tensor subclass costs: ``__torch_dispatch__``, the Gatherer's bookkeeping, the gradient hooks.  Target:
within 1.15x of the plain step (issue 5).

Both models (same seed, same batches, AdamW each) live in one process with no process group; their steps
alternate (plain, sharded, plain, ...), so machine noise hits both alike; the medians after warm-up are compared.

    python benchmarks/bench_overhead.py                 # the issue's GPT: V=4096, d=384, 4 layers, T=128, batch 4
    python benchmarks/bench_overhead.py --modes sequential --steps 30

Writes ``benchmarks/results/overhead.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import time

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shardtensor  # noqa: E402
from bench_peers import add_model_args  # noqa: E402
from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus  # noqa: E402

TARGET = 1.15


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["sequential", "overlapped"], choices=["sequential", "overlapped", "auto"])
    add_model_args(p)  # the GPT of bench_peers.py
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (Default: all cores)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "overhead.json"))
    return p.parse_args(argv)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start, loss.item()


def measure(mode: str, args: argparse.Namespace, corpus: torch.Tensor) -> dict:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim)
    plain = GPT(cfg)
    sharded = shardtensor.shard_module(copy.deepcopy(plain), gather=mode)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
            for name, m in (("plain", plain), ("sharded", sharded))}
    models = {"plain": plain, "sharded": sharded}
    gen = torch.Generator().manual_seed(1000)
    times: dict[str, list[float]] = {"plain": [], "sharded": []}
    losses: dict[str, list[float]] = {"plain": [], "sharded": []}
    for step in range(args.warmup + args.steps):
        x, y = get_batch(corpus, args.batch, args.block, gen)
        order = ("plain", "sharded") if step % 2 == 0 else ("sharded", "plain")
        for name in order:
            t, loss = _step(models[name], opts[name], x, y)
            times[name].append(t)
            losses[name].append(loss)
    plain_s = statistics.median(times["plain"][args.warmup:])
    sharded_s = statistics.median(times["sharded"][args.warmup:])
    pair_ratios = [s / p for s, p in zip(times["sharded"][args.warmup:], times["plain"][args.warmup:])]
    return {
        "mode": mode,
        "plain_step_s": plain_s,
        "sharded_step_s": sharded_s,
        "ratio": sharded_s / plain_s,
        "ratio_median_of_pairs": statistics.median(pair_ratios),
        "ratio_of_min": min(times["sharded"][args.warmup:]) / min(times["plain"][args.warmup:]),
        "target": TARGET,
        "met": sharded_s / plain_s <= TARGET,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["plain"], losses["sharded"])),
        "step_times_s": times,
        "gather_stats": shardtensor.gather_stats(sharded),
    }


def main(argv=None) -> dict:
    args = _parse(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    torch.set_num_threads(args.threads)
    corpus = synthetic_corpus(20_000, args.vocab, seed=0)
    load_before = os.getloadavg()
    rows = [measure(mode, args, corpus) for mode in args.modes]
    print(f"world 1, GPT V={args.vocab} d={args.dim} L={args.layers} T={args.block} batch {args.batch}, "
          f"AdamW, {args.threads} threads, median of {args.steps} steps after {args.warmup}")
    print(f"{'mode':<11} {'plain s':>8} {'sharded s':>9} {'ratio':>6} {'pairs':>6} {'min/min':>7} {'target':>7}  loss diff")
    for r in rows:
        print(f"{r['mode']:<11} {r['plain_step_s']:>8.3f} {r['sharded_step_s']:>9.3f} {r['ratio']:>6.2f} "
              f"{r['ratio_median_of_pairs']:>6.2f} {r['ratio_of_min']:>7.2f} {'MET' if r['met'] else 'NOT MET':>7}  "
              f"{r['max_loss_diff']:.1e}")
    print(f"load average before/after: {load_before[0]:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    result = {
        "command": command,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
                    "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
