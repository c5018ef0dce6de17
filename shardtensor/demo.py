"""Train a small GPT on N CPU ranks with ``shard_module``, then the same model unsharded (DDP), and compare.

    python -m shardtensor.demo                      # 2 gloo ranks spawned here, no torchrun needed
    python -m shardtensor.demo --nproc 4 --steps 60 --gather sequential
    torchrun --nproc-per-node 2 -m shardtensor.demo  # under torchrun: the sharded run only

Memory is the growth of each rank's peak resident set over its size before the model was built
(``MALLOC_MMAP_THRESHOLD_=65536`` is set for the workers so freed tensors leave the process).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import warnings

# torch warns once per process when numpy is missing; nothing here needs numpy (it is not a dependency).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402

from .launch import run_or_exit


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m shardtensor.demo", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (Default: 2)")
    p.add_argument("--steps", type=int, default=25, help="optimizer steps (Default: 25)")
    p.add_argument("--gather", default="overlapped", choices=["sequential", "overlapped", "auto"])
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step (Default: 4)")
    p.add_argument("--block", type=int, default=64, help="sequence length (Default: 64)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--no-baseline", action="store_true", help="skip the unsharded (DDP) run")
    return p.parse_args(argv)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train(args: argparse.Namespace, sharded: bool) -> dict:
    """One rank's run (the process group is already up).  Returns this rank's figures."""
    import psutil
    import torch.distributed as dist
    from tqdm import tqdm

    import shardtensor
    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus

    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = synthetic_corpus(20_000, args.vocab, seed=0)
    rss_before = psutil.Process().memory_info().rss
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.dim)
    model = GPT(cfg)
    if sharded:
        shardtensor.shard_module(model, gather=args.gather)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(1000 + rank)
    label = f"shardtensor ({args.gather})" if sharded else "unsharded (DDP)"
    bar = tqdm(range(args.steps), desc=label, disable=rank != 0, ncols=90, file=sys.stdout)
    losses, times = [], []
    for _ in bar:
        start = time.perf_counter()
        x, y = get_batch(corpus, args.batch, args.block, gen)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / world)
        times.append(time.perf_counter() - start)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    n_params = sum(p.numel() for p in model.parameters())
    # Elements this rank stores for its parameters: its shards when sharded, every element under DDP.
    local = sum(p.to_local().numel() if isinstance(p, shardtensor.ShardedParam) else p.numel()
                for p in model.parameters())
    return {
        "run": label,
        "rank": rank,
        "loss_first": losses[0],
        "loss_last": sum(losses[-5:]) / len(losses[-5:]),
        "peak_mib": (_peak_rss_bytes() - rss_before) / 2**20,
        "step_s": sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0],
        "params": n_params,
        "local_param_elements": local,
    }


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, sharded: bool) -> dict:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)  # MASTER_ADDR/PORT: set by the launcher
    try:
        return train(args, sharded)
    finally:
        dist.destroy_process_group()


def _spawn(args: argparse.Namespace, sharded: bool) -> list[dict]:
    # A rank that raises or dies ends the demo with that rank's error (exit code 1), never a hang.
    return run_or_exit(_worker, args.nproc, args, sharded)


def format_table(rows: list[dict]) -> str:
    head = f"{'run':<26} {'rank':>4} {'loss first':>10} {'loss last':>10} {'peak MiB':>9} {'s/step':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['run']:<26} {r['rank']:>4} {r['loss_first']:>10.4f} {r['loss_last']:>10.4f} "
                     f"{r['peak_mib']:>9.1f} {r['step_s']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
        row = train(args, sharded=True)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        if dist.get_rank() == 0:
            print(format_table(rows))
        dist.destroy_process_group()
        return rows
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the spawned ranks
    start = time.perf_counter()
    rows = _spawn(args, sharded=True)
    if not args.no_baseline:
        rows += _spawn(args, sharded=False)
    print()
    print(format_table(rows))
    if not args.no_baseline:
        ours = max(r["peak_mib"] for r in rows if r["run"].startswith("shardtensor"))
        theirs = max(r["peak_mib"] for r in rows if not r["run"].startswith("shardtensor"))
        print(f"\npeak memory per rank: shardtensor / unsharded = {ours / theirs:.2f}x "
              f"({rows[0]['params'] / 1e6:.1f}M parameters, {args.nproc} ranks, {time.perf_counter() - start:.0f} s)")
    return rows


if __name__ == "__main__":
    main()
