"""CPU cost of the collectives a ZeRO-3 step needs, on 2 gloo ranks: what the "zero3-floor" row of
``bench_peers.py`` pays (torch's flat ``all_gather_into_tensor`` / ``reduce_scatter_tensor``) against what
shardtensor issues on gloo (one broadcast per rank, ``_comm_rows``; its gradient reduce-scatter, by sends since
it was one in-place reduce per rank, both kept here) and DDP's all-reduce.

    python benchmarks/bench_collective_cost.py [--numel 8700000] [--repeats 10] [--world 2] [--out FILE]

Per collective over the benchmark GPT's parameter count: wall ms, and CPU ms of rank 0's process
(``time.process_time``: every thread, gloo's included), medians over ``--repeats`` calls after two warm-up calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def _worker(rank: int, world: int, port: int, numel: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import shardtensor
    from shardtensor import _comm, _comm_rows

    shardtensor.set_divergence_check(False)  # the raw collectives' cost, as the other rows
    full, shard, gathered = torch.randn(numel), torch.randn(numel // world), torch.empty(numel)
    rows = numel // world

    def in_place_gather():  # shardtensor on gloo: each rank's rows broadcast into the full tensor
        works = [dist.broadcast(gathered[r * rows:(r + 1) * rows], src=r, async_op=True) for r in range(world)]
        for w in works:
            w.wait()

    def in_place_reduce_scatter():  # shardtensor on gloo before: each rank's rows reduced onto it, in place
        works = [dist.reduce(full[r * rows:(r + 1) * rows], dst=r, async_op=True) for r in range(world)]
        for w in works:
            w.wait()

    def reduce_scatter_by_sends():  # shardtensor on gloo now: the library's own call (identity check off, as above)
        with _comm.inputs_may_be_overwritten(True):
            _comm_rows.reduce_scatter_in_place([full.view(world, -1)], None)

    cases = {"ddp all_reduce": lambda: dist.all_reduce(full),
             "flat all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, shard),
             "flat reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
             "in-place gather (broadcasts)": in_place_gather,
             "in-place reduce-scatter (reduces)": in_place_reduce_scatter,
             "reduce-scatter by sends (shardtensor)": reduce_scatter_by_sends}
    result = {}
    for name, fn in cases.items():
        for _ in range(2):
            fn()
        walls, cpus = [], []
        for _ in range(repeats):
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            cpus.append(1e3 * (time.process_time() - c0))
            walls.append(1e3 * (time.perf_counter() - t0))
        result[name] = {"wall_ms": statistics.median(walls), "cpu_ms_rank0": statistics.median(cpus)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"numel": numel, "world": world, "repeats": repeats, "per_collective": result}, f, indent=1)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=8_700_000)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "collective_cost.json"))
    args = p.parse_args(argv)
    torch.multiprocessing.spawn(_worker, args=(args.world, 29641, args.numel, args.repeats, args.out), nprocs=args.world)
    with open(args.out) as f:
        data = json.load(f)
    data["command"] = "python benchmarks/bench_collective_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    data["load_average"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    for name, r in data["per_collective"].items():
        print(f"{name:36s} wall {r['wall_ms']:7.1f} ms   cpu (rank 0) {r['cpu_ms_rank0']:6.1f} ms")
    return data


if __name__ == "__main__":
    main()
