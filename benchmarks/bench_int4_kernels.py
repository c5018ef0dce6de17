"""Bandwidth of the 4-bit kernels against the device's copy bandwidth (issue 3, acceptance 5).

Each kernel is timed on large inputs and credited with its minimum memory traffic (bytes it must read and
write); the ratio to a plain ``copy_`` (read + write, the same device, the same run) says how close to the
memory system it runs.  Target on a GPU: >= 0.8 of copy for both fused kernels (``quantize_int4_ef``: gradient
+ error in, packed + scales + error out; ``dequantize_reduce_int4``: W packed chunks + scales in, one fp32 shard
out).  On the CPU the torch references run (Triton's interpreter is a correctness tool, not a speed one): the
figures are recorded for comparison only.

    python benchmarks/bench_int4_kernels.py                      # cuda + Triton when present, else CPU + reference
    python benchmarks/bench_int4_kernels.py --numel 268435456 --chunks 8

Writes ``benchmarks/results/int4_kernels_<device>.json``.
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

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)
from shardtensor import ops  # noqa: E402

TARGET = 0.8


def _timer(device: torch.device, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` (after two warm-up calls: Triton compiles on the first)."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--impl", choices=["auto", "triton", "ref"], default="auto",
                    help="auto: Triton on CUDA, the torch reference on the CPU")
    ap.add_argument("--numel", type=int, default=None, help="gradient elements (Default: 2^28 on CUDA, 2^24 on CPU)")
    ap.add_argument("--chunks", type=int, default=8, help="W: chunks summed by dequantize_reduce (ranks)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          (args.device if args.device != "auto" else "cpu"))
    impl = args.impl if args.impl != "auto" else ("triton" if device.type == "cuda" else "ref")
    n = args.numel or (1 << 28 if device.type == "cuda" else 1 << 24)
    g, w = args.group_size, args.chunks
    fns = {
        "quantize_int4": getattr(ops, f"quantize_int4_{impl}"),
        "dequantize_int4": getattr(ops, f"dequantize_int4_{impl}"),
        "quantize_int4_ef": getattr(ops, f"quantize_int4_ef_{impl}"),
        "dequantize_reduce_int4": getattr(ops, f"dequantize_reduce_int4_{impl}"),
    }

    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(n, device=device, generator=gen)
    error = torch.zeros(1, -(-n // g) * g, device=device)  # one row: the reducer passes (rows, padded cols)
    packed, scales = ops.quantize_int4(grad, g) if impl == "ref" else fns["quantize_int4"](grad, g)
    chunk = n // w  # dequantize_reduce: W received chunks of one shard
    recv_packed = packed[: w * (chunk // 2)].view(w, chunk // 2) if chunk % 2 == 0 else None
    groups = -(-chunk // g)
    recv_scales = torch.rand(w, groups, device=device, generator=gen)
    src, dst = torch.randn(n, device=device, generator=gen), torch.empty(n, device=device)

    scale_bytes = 4 * -(-n // g)
    cases = {  # name -> (callable, minimum bytes moved)
        "copy_ (reference)": (lambda: dst.copy_(src), 8 * n),
        "quantize_int4": (lambda: fns["quantize_int4"](grad, g), 4 * n + n // 2 + scale_bytes),
        "dequantize_int4": (lambda: fns["dequantize_int4"](packed, scales, n, g), n // 2 + scale_bytes + 4 * n),
        "quantize_int4_ef (fused)": (lambda: fns["quantize_int4_ef"](grad, error, g, 0.8),
                                     4 * n + 4 * error.numel() + n // 2 + scale_bytes + 4 * error.numel()),
    }
    if recv_packed is not None:
        cases["dequantize_reduce_int4 (fused)"] = (
            lambda: fns["dequantize_reduce_int4"](recv_packed, recv_scales, chunk, g),
            w * (chunk // 2 + 4 * groups) + 4 * chunk)

    rows = []
    for name, (fn, nbytes) in cases.items():
        seconds = _timer(device, fn, args.repeats)
        rows.append({"kernel": name, "ms": seconds * 1e3, "bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9})
    copy = rows[0]["gb_per_s"]
    for r in rows:
        r["fraction_of_copy"] = r["gb_per_s"] / copy

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    print(f"int4 kernels ({impl}) on {device.type} ({name}), {n / 1e6:.0f}M elements, group {g}, W={w}, "
          f"median of {args.repeats}")
    print(f"{'kernel':<32}{'ms':>9}{'GB/s':>9}{'x copy':>8}")
    for r in rows:
        print(f"{r['kernel']:<32}{r['ms']:>9.3f}{r['gb_per_s']:>9.1f}{r['fraction_of_copy']:>8.2f}")
    fused = [r for r in rows if "fused" in r["kernel"]]
    if device.type == "cuda" and impl == "triton":
        met = all(r["fraction_of_copy"] >= TARGET for r in fused)
        print(f"fused kernels >= {TARGET} of copy bandwidth: {'MET' if met else 'NOT MET'}")
    else:
        met = None
        print("(CPU reference path: recorded for comparison; the bandwidth target applies to the Triton kernels on "
              "a GPU)")

    result = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + (argv or sys.argv[1:])),
        "config": {"device": device.type, "device_name": name, "impl": impl, "numel": n, "group_size": g,
                   "chunks": w, "repeats": args.repeats},
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "rows": rows,
        "target_fraction_of_copy": TARGET,
        "met": met,
    }
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"int4_kernels_{device.type}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
