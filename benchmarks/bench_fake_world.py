"""Exact per-rank memory at a world size this machine cannot run: one process acts as rank R of W (fake PG).

``torch.testing._internal.distributed.fake_pg`` gives a process group whose collectives return at once without
moving data (the values are garbage, the allocations are real), so a single process holds exactly what rank R of
a W-rank job holds: its shards, its gathered buffers, its gradients and optimizer state, and the activations of
its batch.  Each configuration runs in a fresh process: the model is built on the meta device and wrapped, then
materialised (only this rank's shards are ever allocated); the peak is the growth of the resident set (VmHWM,
reset after the wrap) over the timed steps, with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave.

    python benchmarks/bench_fake_world.py                  # GPT ~1B params (d=2048, 18 layers), rank 3 of 8
    python benchmarks/bench_fake_world.py --dim 1024 --layers 8 --steps 2

No gloo temporaries here (the fake PG allocates none): the figures are the libraries' own memory.  Step times
are not reported: nothing is communicated.  Writes ``benchmarks/results/fake_world<W>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

CONFIGS = ["fsdp2", "st-sequential", "st-overlapped"]


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
        f.write("5")


def run_config(_rank: int, _world: int, _port: int, config: str, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process (one spawned rank; the fake group is its own world)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    import shardtensor
    from shardtensor.models import GPT, GPTConfig

    # Build AdamW once first: its construction imports torch._dynamo (~95 MiB) in every process.
    layer = torch.nn.Linear(4, 4)
    torch.optim.AdamW(layer.parameters()).step()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim)
    before_model = _status_mib("VmRSS")
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if config == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")  # this rank's shards only; values do not matter for memory
    else:
        kwargs = {} if args.prefetch_bytes is None else {"prefetch_bytes": args.prefetch_bytes}
        shardtensor.shard_module(model, gather=config.removeprefix("st-"), **kwargs)
        shardtensor.materialize(model, init_fn=lambda m: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    after_wrap = _status_mib("VmRSS") - before_model
    x = torch.randint(0, args.vocab, (args.batch, args.block))
    _reset_peak()
    base = _status_mib("VmRSS")
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _status_mib("VmHWM") - base
    dist.destroy_process_group()
    return {"config": config, "params": n_params, "after_wrap_mib": after_wrap,
            "state_before_steps_mib": base - before_model, "peak_growth_mib": peak,
            "peak_total_mib": peak + base - before_model, "seconds": time.perf_counter() - start}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rank", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=CONFIGS, choices=CONFIGS)
    ap.add_argument("--prefetch-bytes", type=int, default=None, help="shardtensor overlapped budget (Default: its own)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from shardtensor.launch import run_or_exit

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at process start: set before spawning
    rows = []
    for config in args.configs:
        rows.append(run_or_exit(run_config, 1, config, args)[0])  # a failed run: its traceback, exit code 1
        r = rows[-1]
        print(f"{config:<14} after wrap {r['state_before_steps_mib']:8.1f} MiB  peak {r['peak_total_mib']:8.1f} MiB  "
              f"({r['seconds']:.0f} s)", flush=True)
    ref = next((r for r in rows if r["config"] == "fsdp2"), None)
    for r in rows:
        r["x_fsdp2"] = r["peak_total_mib"] / ref["peak_total_mib"] if ref else None
    params = rows[0]["params"]
    print(f"\nGPT {params / 1e9:.2f}B params (V={args.vocab}, d={args.dim}, L={args.layers}, T={args.block}, batch "
          f"{args.batch}), AdamW, rank {args.rank} of {args.world} (fake process group)")
    print("| config | after wrap MiB | peak MiB | x FSDP2 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['x_fsdp2']:.2f}" if r["x_fsdp2"] is not None else "-"
        print(f"| {r['config']} | {r['state_before_steps_mib']:.1f} | {r['peak_total_mib']:.1f} | {ratio} |")
    result = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv or sys.argv[1:])),
        "config": vars(args) | {"configs": args.configs},
        "memory_metric": "resident set growth from before the model is built; peak = VmHWM over the timed steps",
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "rows": rows,
    }
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"fake_world{args.world}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
