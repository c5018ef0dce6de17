"""Layer-wise placement: does prefetching the owners' broadcasts overlap them with compute, and what does a step
cost beside dim-0 sharding?

A small GPT (``shardtensor.models``) on W gloo CPU ranks, one training step = forward + backward + optimizer step
+ zero_grad, each rank on its own batch.  Configurations (every one starts from the same weights):

- ``layerwise/on-demand``  : ``shard_module(placement="layerwise", gather="sequential")``: each op broadcasts its
  parameter from the owner when it needs it and waits;
- ``layerwise/overlapped`` : ``gather="overlapped"``: after the first (recording) step, the broadcasts of the next
  parameters in the recorded order are issued asynchronously while the current op computes;
- both with stock ``torch.optim.AdamW`` and with ``shardtensor.optim.Muon`` (Muon on owned 2-d weights);
- ``dim0/...`` : the default dim-0 sharding with AdamW, the same two gather modes (Muon cannot run on dim-0
  shards: Newton-Schulz needs whole matrices).

Timing: the configurations are measured round-robin (``--rounds`` rounds of ``--steps`` steps each, Muon
``--muon-steps``: ``torch.optim.Muon`` orthogonalises in bfloat16, which CPUs without bf16 units run ~40x slower
than float32 matmuls, so a Muon step costs seconds here; on a GPU it is a small part of the step), so a burst of
load from other processes on a shared machine falls on all of them alike; a barrier precedes every step; a step's
time is the slowest rank's.  Reported: the median step time per configuration; per round the ratio
on-demand / overlapped (its median and range), the overlap gain with the drift removed; and the *exposed* gather
time per step (the calling thread's time inside ``_comm.broadcast`` / ``_comm.all_gather_rows`` and in the waits
on their handles), which is the communication that overlap did not hide.

The default model is small-batch (1 sequence of 16 tokens per rank, n_embd 512): the regime where moving
parameters is a large part of a step, which is where placement and overlap matter.  On this 2-core machine the
gloo transfers are themselves CPU work (loopback copies on gloo's thread) competing with the two ranks' compute,
so overlap can hide their latency but not their CPU cost.

Peers: veScale-FSDP and Dion keep dim-0 shards and, per step, send each matrix whole to one
rank, orthogonalise it there and scatter the result back: two extra collectives per matrix per optimizer step,
on top of the usual all-gathers.  Layer-wise placement pays nothing extra at the step (the gradient is reduced to
the owner, the update stays there) and moves the cost into the forward: a broadcast sends the whole tensor from
one rank where an all-gather spreads the sending, and the Muon work is balanced by bytes, not by
Newton-Schulz flops (``opt ms`` per rank shows the imbalance).  We have not run veScale or Dion here.

    python benchmarks/bench_layerwise.py                    # 2 ranks, writes results/layerwise.json / .txt
    python benchmarks/bench_layerwise.py --rounds 2 --steps 2 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

from shardtensor.launch import run_or_exit

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CONFIGS = (
    ("layerwise", "sequential", "adamw"),
    ("layerwise", "overlapped", "adamw"),
    ("layerwise", "sequential", "muon"),
    ("layerwise", "overlapped", "muon"),
    ("dim0", "sequential", "adamw"),
    ("dim0", "overlapped", "adamw"),
)


def _name(placement: str, gather: str, opt: str) -> str:
    mode = "on-demand" if gather == "sequential" else gather
    return f"{placement}/{mode}/{opt}"


class _CommMeter:
    """Wraps ``_comm.broadcast`` (layer-wise gathers) and ``_comm.all_gather_rows`` (dim-0 gathers): bytes gathered,
    and the *exposed* time, i.e. what the calling thread spends inside them: the whole call when it is
    synchronous; the issue plus the later ``wait()`` when it is asynchronous (a prefetch that finished behind
    compute costs almost nothing here).  Step time minus this is what overlap cannot remove."""

    def __init__(self):
        from shardtensor import _comm

        self.bytes = 0
        self.exposed = 0.0
        meter = self

        class _TimedWork:
            def __init__(self, work):
                self.work = work

            def wait(self, *args, **kwargs):
                t = time.perf_counter()
                try:
                    return self.work.wait(*args, **kwargs)
                finally:
                    meter.exposed += time.perf_counter() - t

            def __getattr__(self, name):
                return getattr(self.work, name)

        def timed(original, buffer_of, work_of, rewrap):
            def call(*args, async_op: bool = False, **kwargs):
                t = time.perf_counter()
                out = original(*args, async_op=async_op, **kwargs)
                meter.exposed += time.perf_counter() - t
                meter.bytes += buffer_of(args, out).numel() * buffer_of(args, out).element_size()
                return rewrap(out, _TimedWork(work_of(out))) if async_op else out

            return call

        _comm.broadcast = timed(_comm.broadcast, lambda args, out: args[0], lambda out: out, lambda out, w: w)
        _comm.all_gather_rows = timed(_comm.all_gather_rows, lambda args, out: out.buffer, lambda out: out.work,
                                      lambda out, w: out._replace(work=w))


def _rank_main(rank: int, world: int, port: int, args: dict) -> dict:
    torch.set_num_threads(args["threads"])
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return _measure(rank, world, args)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    import shardtensor
    from shardtensor.models import GPT, GPTConfig, get_batch, synthetic_corpus
    from shardtensor.optim import Muon

    meter = _CommMeter()
    cfg = GPTConfig(**args["model"])
    torch.manual_seed(0)
    base = GPT(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    corpus = synthetic_corpus(20_000, cfg.vocab_size)
    runs = {}
    for placement, gather, opt_name in CONFIGS:
        if opt_name == "muon" and not args["muon_steps"]:
            continue
        model = shardtensor.shard_module(copy.deepcopy(base), placement=placement, gather=gather)
        if opt_name == "muon":
            opt = Muon(model, lr=0.02, adamw_lr=3e-3)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        steps = args["muon_steps"] if opt_name == "muon" else args["steps"]
        runs[_name(placement, gather, opt_name)] = {"model": model, "opt": opt, "steps": steps, "times": [],
                                                    "opt_times": [], "exposed": [], "losses": [],
                                                    "gen": torch.Generator().manual_seed(1000 + rank)}

    def step(run: dict) -> float:
        x, y = get_batch(corpus, args["batch"], cfg.block_size, run["gen"])
        dist.barrier()
        exposed_before = meter.exposed
        t = time.perf_counter()
        loss = run["model"](x, y)
        loss.backward()
        t_opt = time.perf_counter()
        run["opt"].step()
        run["opt"].zero_grad()
        elapsed = time.perf_counter() - t
        run["opt_times"].append(time.perf_counter() - t_opt)
        run["exposed"].append(meter.exposed - exposed_before)
        run["losses"].append(loss.item())
        return elapsed

    for run in runs.values():  # warm-up: the first step records the gather order
        for _ in range(args["warmup"] if run["steps"] > 1 else 1):
            step(run)
    per_round: dict[str, list[float]] = {name: [] for name in runs}
    gathered_bytes = {}
    for _round in range(args["rounds"]):
        for name, run in runs.items():
            before = meter.bytes
            times = [step(run) for _ in range(run["steps"])]
            gathered_bytes[name] = (meter.bytes - before) // run["steps"]
            run["times"] += times
            per_round[name].append(statistics.median(times))
    out = {"n_params": n_params, "per_round": per_round, "times": {n: r["times"] for n, r in runs.items()},
           "opt_times": {n: r["opt_times"] for n, r in runs.items()},
           "exposed": {n: r["exposed"][-len(r["times"]):] for n, r in runs.items()},
           "losses": {n: r["losses"] for n, r in runs.items()}, "gathered_bytes_per_step": gathered_bytes,
           "gather_stats": {n: shardtensor.gather_stats(r["model"]) for n, r in runs.items()}}
    if rank == 0:
        out["plan"] = shardtensor.placement_plan(runs[_name(*CONFIGS[0])]["model"])
    return out


def run(world: int, args: dict) -> list[dict]:
    return run_or_exit(_rank_main, world, args)  # a failed rank: its traceback, exit code 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per configuration per round")
    parser.add_argument("--muon-steps", type=int, default=1,
                        help="timed Muon steps per round, 0 = no Muon (torch.optim.Muon orthogonalises in bf16: slow on CPUs)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--block", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "layerwise"))
    opts = parser.parse_args()
    args = {
        "rounds": opts.rounds, "steps": opts.steps, "muon_steps": opts.muon_steps, "warmup": 2, "batch": opts.batch,
        "threads": opts.threads,
        "model": {"vocab_size": 1024, "block_size": opts.block, "n_layer": opts.n_layer, "n_head": 4,
                  "n_embd": opts.n_embd},
    }
    t0 = time.perf_counter()
    ranks = run(opts.world, args)
    wall = time.perf_counter() - t0
    names = list(ranks[0]["times"])
    # a step's time is the slowest rank's (they meet in every collective)
    step_times = {n: [max(r["times"][n][i] for r in ranks) for i in range(len(ranks[0]["times"][n]))] for n in names}
    round_times = {n: [max(r["per_round"][n][i] for r in ranks) for i in range(opts.rounds)] for n in names}

    rows = []
    for name in names:
        placement, mode, opt = name.split("/")
        row = {"config": name, "placement": placement, "gather": mode, "optimizer": opt,
               "median_step_ms": 1e3 * statistics.median(step_times[name]),
               "min_step_ms": 1e3 * min(step_times[name]),
               "median_exposed_gather_ms_per_rank": [1e3 * statistics.median(r["exposed"][name]) for r in ranks],
               "median_optimizer_step_ms_per_rank": [1e3 * statistics.median(r["opt_times"][name]) for r in ranks],
               "gathered_MB_per_step_rank0": ranks[0]["gathered_bytes_per_step"][name] / 1e6,
               "gather_stats_rank0": ranks[0]["gather_stats"][name],
               "last_loss_rank0": ranks[0]["losses"][name][-1]}
        if mode == "overlapped":
            partner = f"{placement}/on-demand/{opt}"
            ratios = [a / b for a, b in zip(round_times[partner], round_times[name])]
            row["on_demand_over_overlapped"] = {"median": statistics.median(ratios), "min": min(ratios),
                                                "max": max(ratios), "per_round": ratios}
        rows.append(row)
    ref = next(r for r in rows if r["config"] == "dim0/overlapped/adamw")["median_step_ms"]
    lines = [f"{'config':28s} {'ms/step':>8s} {'min ms':>8s} {'vs dim0/ovl':>11s} {'gather wait ms r0/r1':>20s} "
             f"{'opt ms r0/r1':>13s} {'gathered MB':>11s} {'on-demand/overlapped (median [min, max] of rounds)':>51s}"]
    for r in rows:
        gain = r.get("on_demand_over_overlapped")
        gain_s = f"{gain['median']:.3f} [{gain['min']:.3f}, {gain['max']:.3f}]" if gain else "-"
        wait_s = "/".join(f"{t:.1f}" for t in r["median_exposed_gather_ms_per_rank"])
        opt_s = "/".join(f"{t:.0f}" for t in r["median_optimizer_step_ms_per_rank"])
        lines.append(f"{r['config']:28s} {r['median_step_ms']:8.1f} {r['min_step_ms']:8.1f} "
                     f"{r['median_step_ms'] / ref:11.2f} {wait_s:>20s} {opt_s:>13s} "
                     f"{r['gathered_MB_per_step_rank0']:11.2f} {gain_s:>51s}")
    table = "\n".join(lines)
    print(table)

    root = os.path.join(os.path.dirname(__file__), "..")
    meta = {
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], root)] + sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "load_average_at_end": os.getloadavg(),
        "torch": torch.__version__,
        "world": opts.world,
        "config": args,
        "n_params": ranks[0]["n_params"],
        "wall_seconds": wall,
        "setup": "shard_module(GPT, placement=..., gather=...) on gloo CPU ranks; step = forward + backward + "
                 "optimizer step + zero_grad, barrier before each; a step's time = the slowest rank's; "
                 "configurations measured round-robin",
    }
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    with open(opts.out + ".json", "w") as f:
        json.dump({"meta": meta, "table": rows, "round_ms": {n: [1e3 * t for t in v] for n, v in round_times.items()},
                   "plan": ranks[0]["plan"]}, f, indent=1)
    with open(opts.out + ".txt", "w") as f:
        f.write(f"# {meta['command']}\n# {meta['machine']}, torch {meta['torch']}, world {opts.world}, "
                f"{meta['n_params']:,} params, load average at end {meta['load_average_at_end']}\n{table}\n")
    print(f"wrote {opts.out}.json, .txt")


if __name__ == "__main__":
    main()
