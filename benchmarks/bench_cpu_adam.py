"""Is CPUAdam's step at least as fast as torch's fused CPU AdamW?

Head to head first, on two configurations in one run (``--configs``): ``single``, one 20M-element tensor, and
``gpt``, the 24 tensors of two GPT blocks (d=1024, 25M parameters).  For each, CPUAdam with its *default*
arguments (speculative, inf/NaN check: inside the step when ``shardtensor.ops.adamw_cpu_kernel_status()`` is
"ok", printed first), CPUAdam's bare step (``skip_nonfinite=False``: no check, torch's fused kernel) and
torch's fused AdamW step the same parameters and gradients, each with its own state, in interleaved rounds (one
step of each per round, the order rotated every round); the report gives each one's median and the median of
the per-round ratios fused/CPUAdam with its spread (min, quartiles, max): on a shared machine step times drift
10-25% but the ratio within a round does not.  ``--table`` adds the full table below for the ``--layout``.

Every optimizer steps the *same* parameter and gradient tensors (CPU fp32, or the device with ``--device cuda``),
each with its own state; timings are interleaved (one step of each, repeated) and the median is reported.
GB/s counts AdamW's minimum traffic, 28 bytes/param (read p, g, m, v; write p, m, v), beside a measured
memory-copy rate (8 bytes/element: read + write) on the same machine.  The rollback row times
``CPUAdam.rollback()`` (foreach inversion), and the JSON records the inversion error of one step.

    python benchmarks/bench_cpu_adam.py --threads 1           # head to head, both configurations
    python benchmarks/bench_cpu_adam.py --table               # ... and the table: 'model' layout, 32M params
    python benchmarks/bench_cpu_adam.py --layout large --numel 33554432
    python benchmarks/bench_cpu_adam.py --device cuda         # params on the GPU, CPUAdam state on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from shardtensor.ops import adamw_cpu_kernel_status  # noqa: E402
from shardtensor.optim import CPUAdam  # noqa: E402

BYTES_PER_PARAM = 28  # fp32 p, g, m, v read; p, m, v written


def shapes_for(layout: str, numel: int) -> list[tuple[int, ...]]:
    """'large': 4 equal matrices.  'model': transformer-like blocks (4 d^2 attention, 8 d^2 MLP, 9 vectors)."""
    if layout == "large":
        rows = max(1, numel // (4 * 1024))
        return [(rows, 1024)] * 4
    d = 1024
    per_block = 12 * d * d + 13 * d
    blocks = max(1, numel // per_block)
    out: list[tuple[int, ...]] = []
    for _ in range(blocks):
        out += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def memcpy_gbps(numel: int, repeats: int) -> float:
    x = torch.randn(numel)
    y = torch.empty_like(x)
    y.copy_(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        y.copy_(x)
        times.append(time.perf_counter() - t)
    return 8 * numel / statistics.median(times) / 1e9


def rollback_error(shape, seed: int = 0) -> dict:
    """One step then rollback() on a warm state; error in float32 ulps of the cancelled term, bit-exact fractions."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(shape, generator=g))
    opt = CPUAdam([p], lr=1e-3, speculative=False)
    for _ in range(10):
        p.grad = 0.01 * torch.randn(shape, generator=g)
        opt.step()
    st = opt.state[p]
    before = dict(p=p.detach().clone(), m=st["exp_avg"].clone(), v=st["exp_avg_sq"].clone())
    p.grad = 0.01 * torch.randn(shape, generator=g)
    opt.step()
    opt.rollback()
    after = dict(p=p.detach(), m=st["exp_avg"], v=st["exp_avg_sq"])
    eps = torch.finfo(torch.float32).eps
    gr = p.grad.abs()
    unit = dict(p=eps * torch.maximum(before["p"].abs(), torch.tensor(1e-3)),
                m=eps * torch.maximum(before["m"].abs(), 0.1 * gr), v=eps * torch.maximum(before["v"], 1e-3 * gr * gr))
    out = {}
    for k in ("p", "m", "v"):
        d = (after[k] - before[k]).abs()
        out[k] = dict(bit_exact_fraction=(d == 0).float().mean().item(), max_abs=d.max().item(),
                      max_ulps_of_cancelled_term=(d / unit[k]).max().item())
    return out


def quantiles(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return dict(min=min(xs), q1=q[0], median=statistics.median(xs), q3=q[2], max=max(xs))


def head_to_head(config: str, device: str, rounds: int, hp: dict) -> dict:
    """Interleaved rounds of CPUAdam (default), CPUAdam (bare) and torch fused AdamW on one configuration."""
    shapes = [(20_000_000,)] if config == "single" else shapes_for("model", 2 * (12 * 1024 * 1024 + 13 * 1024))
    params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    for p in params:
        p.grad = 0.01 * torch.randn_like(p)
    impls = {
        "CPUAdam default": CPUAdam(params, **hp),
        "CPUAdam bare": CPUAdam(params, speculative=False, skip_nonfinite=False, **hp),
        "torch AdamW fused": torch.optim.AdamW(params, fused=True, **hp),
    }
    for opt in impls.values():  # state allocation outside the timings
        opt.step()
    sync(device)
    names = list(impls)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t = time.perf_counter()
            impls[name].step()
            sync(device)
            times[name].append(time.perf_counter() - t)
    fused = times["torch AdamW fused"]
    out = dict(config=config, tensors=len(shapes), numel=sum(p.numel() for p in params), rounds=rounds,
               median_ms={k: statistics.median(v) * 1e3 for k, v in times.items()},
               speed_vs_fused={k: quantiles([f / t for f, t in zip(fused, times[k])]) for k in names[:2]})
    for k in names[:2]:
        q = out["speed_vs_fused"][k]
        print(f"{config:>6} ({out['tensors']} tensors, {out['numel'] / 1e6:.1f}M): {k:<16} "
              f"{out['median_ms'][k]:8.2f} ms vs fused {out['median_ms']['torch AdamW fused']:8.2f} ms; speed vs "
              f"fused, per-round ratios: median {q['median']:.3f}x (min {q['min']:.3f}, q1 {q['q1']:.3f}, "
              f"q3 {q['q3']:.3f}, max {q['max']:.3f}; {rounds} rounds)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", choices=["model", "large"], default="model")
    ap.add_argument("--numel", type=int, default=32 << 20, help="approximate total parameters")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--head-to-head", type=int, default=100, help="alternating CPUAdam / torch fused steps")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--configs", default="single,gpt", help="head-to-head configurations: single, gpt")
    ap.add_argument("--rounds", type=int, default=30, help="interleaved head-to-head rounds per configuration")
    ap.add_argument("--table", action="store_true", help="also the full table on --layout / --numel")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/cpu_adam_<layout>_<device>.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    print(f"torch {torch.__version__}, {args.threads} threads, device={args.device}, load average {os.getloadavg()}, "
          f"checked CPU kernel: {adamw_cpu_kernel_status()}")
    heads = [head_to_head(c, args.device, args.rounds, hp) for c in args.configs.split(",") if c]
    if not args.table:
        out = args.out or os.path.join(os.path.dirname(__file__), "results", f"cpu_adam_head_to_head_{args.device}.json")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                           threads=args.threads, load_average=os.getloadavg(), torch=torch.__version__,
                           checked_kernel=adamw_cpu_kernel_status(),
                           hyper=dict(hp, betas=list(hp["betas"])), head_to_head=heads), f, indent=2)
        print(f"wrote {out}")
        return

    shapes = shapes_for(args.layout, args.numel)
    params = [torch.nn.Parameter(torch.randn(s, device=args.device)) for s in shapes]
    for p in params:
        p.grad = 0.01 * torch.randn_like(p)
    numel = sum(p.numel() for p in params)

    # Rows: the bare step (no inf/NaN check, as torch's), the default (inf/NaN check: one read of the grads),
    # and both sides with clipping (a norm that never clips: same passes, comparable numbers).
    clip_ref = torch.optim.AdamW(params, fused=True, **hp)

    class FusedWithClip:
        def step(self):
            torch.nn.utils.clip_grad_norm_(params, 1e30, foreach=True)
            clip_ref.step()

    impls = {
        "CPUAdam": CPUAdam(params, speculative=False, skip_nonfinite=False, **hp),
        "CPUAdam +inf check": CPUAdam(params, speculative=False, **hp),
        "CPUAdam +clip": CPUAdam(params, speculative=False, max_grad_norm=1e30, **hp),
        "torch fused +clip": FusedWithClip(),
        "torch AdamW fused": torch.optim.AdamW(params, fused=True, **hp),
        "torch AdamW foreach": torch.optim.AdamW(params, foreach=True, **hp),
        "torch AdamW for-loop": torch.optim.AdamW(params, foreach=False, **hp),
    }
    times: dict[str, list[float]] = {k: [] for k in impls}
    times["CPUAdam rollback"] = []
    for opt in impls.values():  # state allocation outside the timings
        opt.step()
    sync(args.device)

    # Head to head first: only the two bare steps, alternating, so no other row's temporaries or cache traffic
    # sits between them; the median of the per-pair ratios cancels the machine's drift.
    pair = {"CPUAdam": impls["CPUAdam"], "torch AdamW fused": impls["torch AdamW fused"]}
    head: dict[str, list[float]] = {k: [] for k in pair}
    for i in range(args.head_to_head):
        for name in (tuple(pair) if i % 2 == 0 else tuple(reversed(pair))):
            t = time.perf_counter()
            pair[name].step()
            sync(args.device)
            head[name].append(time.perf_counter() - t)
    head_ratio = statistics.median(f / c for f, c in zip(head["torch AdamW fused"], head["CPUAdam"]))
    for _ in range(args.repeats):
        for name, opt in impls.items():
            t = time.perf_counter()
            opt.step()
            sync(args.device)
            times[name].append(time.perf_counter() - t)
            if name == "CPUAdam":  # before another row's clip_grad_norm_ rewrites the grads it used
                t = time.perf_counter()
                opt.rollback()
                sync(args.device)
                times["CPUAdam rollback"].append(time.perf_counter() - t)

    copy_gbps = memcpy_gbps(numel, args.repeats)
    fused = statistics.median(times["torch AdamW fused"])
    fused_min = min(times["torch AdamW fused"])  # on a contended machine the minimum is the steadier estimate
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        gbps = BYTES_PER_PARAM * numel / med / 1e9
        rows.append(dict(impl=name, median_ms=med * 1e3, min_ms=min(ts) * 1e3, gparams_per_s=numel / med / 1e9,
                         gb_per_s=gbps, fraction_of_memcpy=gbps / copy_gbps, speed_vs_fused=fused / med,
                         speed_vs_fused_min=fused_min / min(ts),
                         # each repeat times both back to back: the median of those ratios cancels machine drift
                         speed_vs_fused_paired=statistics.median(f / t for f, t in zip(times["torch AdamW fused"], ts))))

    print(f"AdamW step, {numel / 1e6:.1f}M params in {len(shapes)} tensors ({args.layout}), device={args.device}, "
          f"{args.threads} threads, torch {torch.__version__}; memcpy {copy_gbps:.1f} GB/s; median of {args.repeats}")
    print(f"{'impl':<22}{'ms':>9}{'min ms':>9}{'Gparam/s':>10}{'GB/s':>8}{'of memcpy':>11}{'vs fused':>10}{'(min)':>8}{'(paired)':>10}")
    for r in rows:
        print(f"{r['impl']:<22}{r['median_ms']:>9.2f}{r['min_ms']:>9.2f}{r['gparams_per_s']:>10.3f}"
              f"{r['gb_per_s']:>8.1f}{r['fraction_of_memcpy']:>10.2f}x{r['speed_vs_fused']:>9.2f}x"
              f"{r['speed_vs_fused_min']:>7.2f}x{r['speed_vs_fused_paired']:>9.2f}x")
    print(f"head to head ({args.head_to_head} alternating steps of the two alone): CPUAdam "
          f"{statistics.median(head['CPUAdam']) * 1e3:.2f} ms, torch fused "
          f"{statistics.median(head['torch AdamW fused']) * 1e3:.2f} ms; speed vs fused (median of pair ratios) "
          f"{head_ratio:.3f}x")
    err = rollback_error((1024, 1024))
    print("rollback error (1 step, 1M params, warm state):",
          {k: f"exact {v['bit_exact_fraction']:.3f}, max {v['max_ulps_of_cancelled_term']:.2f} ulp" for k, v in err.items()})

    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"cpu_adam_{args.layout}_{args.device}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(
            command="python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            config=dict(layout=args.layout, numel=numel, tensors=len(shapes), threads=args.threads,
                        device=args.device, repeats=args.repeats, hyper=dict(hp, betas=list(hp["betas"]))),
            machine=dict(cpu=platform.processor() or platform.machine(), cores=os.cpu_count(), torch=torch.__version__),
            load_average=os.getloadavg(), memcpy_gb_per_s=copy_gbps, bytes_per_param=BYTES_PER_PARAM, results=rows,
            rollback_error=err, head_to_head_configs=heads,
            head_to_head=dict(steps=args.head_to_head, cpu_adam_median_ms=statistics.median(head["CPUAdam"]) * 1e3,
                              fused_median_ms=statistics.median(head["torch AdamW fused"]) * 1e3,
                              speed_vs_fused_paired=head_ratio),
        ), f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
