"""Step time and memory of CPUAdam with its moments resident vs in NVMeOffload (one CPU process).

Question: what does swapping optimizer state to files cost per step, and how much resident memory does it save?
Model: an MLP of ``--width`` x ``--layers`` (fp32); optimizer CPUAdam (non-speculative); NVMe budget
``--budget-mib``.  Reported per configuration: median step time, resident optimizer-state high-water mark (the
swap layer's accounting; the resident run holds all 8 bytes/param), RSS growth over the run (psutil), bytes
written and read per step.  GPU figures (issue 7 acceptance 3) need a CUDA machine and are not produced here.

Usage: python benchmarks/bench_offload.py [--width 1024 --layers 8 --steps 8 --budget-mib 16 --dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import psutil
import torch
from torch import nn

from shardtensor.offload import NVMeCPUAdam, NVMeOffload
from shardtensor.optim import CPUAdam


def run(kind: str, args) -> dict:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = nn.Sequential(*layers)
    n = sum(p.numel() for p in model.parameters())
    rss0 = psutil.Process().memory_info().rss
    offload = None
    if kind == "resident":
        opt = CPUAdam(model.parameters(), lr=1e-3, speculative=False)
    else:
        offload = NVMeOffload(tempfile.mkdtemp(dir=args.dir), budget_bytes=args.budget_mib << 20,
                              durable=kind == "nvme-durable")
        opt = NVMeCPUAdam(model.parameters(), offload, lr=1e-3, speculative=False)
    x = torch.randn(args.batch, args.width)
    times, peak_rss = [], rss0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        peak_rss = max(peak_rss, psutil.Process().memory_info().rss)
    out = dict(kind=kind, params=n, state_bytes=8 * n, step_s_median=statistics.median(times[1:]),
               step_s_first=times[0], rss_growth_bytes=peak_rss - rss0)
    if offload is not None:
        s = offload.stats()
        out.update(resident_state_peak_bytes=s["peak_resident_bytes"], budget_bytes=s["budget_bytes"],
                   written_per_step=s["bytes_written"] / args.steps, read_per_step=s["bytes_read"] / args.steps)
        opt.close()
        offload.close()
    else:
        out.update(resident_state_peak_bytes=8 * n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--budget-mib", type=int, default=16)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "offload_cpu.json"))
    args = ap.parse_args()
    # resident twice (first and last): the first run in a process pays allocator warm-up on this machine
    rows = [run(k, args) for k in ("resident", "nvme", "nvme-durable", "resident")]
    print(f"{'config':14} {'params':>9} {'step ms':>8} {'state resident MiB':>19} {'RSS growth MiB':>15} "
          f"{'write MiB/step':>15}")
    for r in rows:
        print(f"{r['kind']:14} {r['params']:9d} {1e3 * r['step_s_median']:8.1f} "
              f"{r['resident_state_peak_bytes'] / 2**20:19.1f} {r['rss_growth_bytes'] / 2**20:15.1f} "
              f"{r.get('written_per_step', 0) / 2**20:15.1f}")
    with open(args.out, "w") as f:
        json.dump(dict(config=vars(args), load_average=os.getloadavg(), cpu_count=os.cpu_count(),
                       swap_dir_fs=args.dir, rows=rows,
                       note="CPU only; GPU offload figures (acceptance 3) need a CUDA machine"), f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
