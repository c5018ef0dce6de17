"""What the cross-rank identity check costs a step: the seconds spent inside it, measured in the same steps.

Why not only "with vs without" runs: on a shared, loaded machine two runs differ by more than the check costs;
the time inside the check, summed over the steps it runs in, is the direct figure.  Trains the GPT of
``bench_fsdp2.py`` at its default config (V=4096, d=384, 4 layers, T=128, batch 4 per rank, AdamW, 2 gloo ranks)
with ``shard_module(gather=mode)`` and reports, per mode: median step, identity checks per step, seconds in them
per step, and their share of the step.

    python benchmarks/bench_divergence_check.py [--steps 6] [--modes sequential overlapped]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _worker(rank: int, world: int, port: int, args) -> tuple:
    import os

    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return rank, _rank(rank, args)
    finally:
        dist.destroy_process_group()


def _rank(rank: int, args) -> dict:
    import torch.distributed as dist

    import shardtensor
    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus

    corpus = synthetic_corpus(20_000, 4096, seed=0)
    gen = torch.Generator().manual_seed(1000 + rank)
    out = {}
    for mode in args.modes:
        torch.manual_seed(0)
        model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=4096, block_size=128, n_layer=4, n_head=6,
                                                       n_embd=384)), gather=mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        times, checks, seconds = [], [], []
        for step in range(args.warmup + args.steps):
            x, y = get_batch(corpus, 4, 128, gen)
            dist.barrier()
            before = shardtensor.identity_check_stats()
            start = time.perf_counter()
            model(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            elapsed = time.perf_counter() - start
            after = shardtensor.identity_check_stats()
            if step >= args.warmup:
                times.append(elapsed)
                checks.append(after["checks"] - before["checks"])
                seconds.append(after["seconds"] - before["seconds"])
        out[mode] = {"step_s": statistics.median(times), "checks": statistics.median(checks),
                     "check_s": statistics.median(seconds),
                     "share": statistics.median(s / t for s, t in zip(seconds, times))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["sequential", "overlapped"])
    args = p.parse_args()
    from shardtensor.launch import spawn_ranks

    results = [res for _, res in sorted(spawn_ranks(_worker, 2, args), key=lambda item: item[0])]
    for mode in args.modes:
        for r, res in enumerate(results):
            m = res[mode]
            print(f"{mode:<11} rank {r}: median step {m['step_s']:.3f} s, {m['checks']:.0f} identity checks/step, "
                  f"{m['check_s'] * 1e3:.1f} ms in them/step = {100 * m['share']:.2f}% of the step (median)")


if __name__ == "__main__":
    main()
