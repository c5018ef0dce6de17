"""A pool of gloo worker processes per world size, started once per pytest session.

Why: starting a process that imports torch costs seconds; a property test with 20 examples x 3 world sizes
cannot afford fresh processes per example.  The pytest process draws the example (hypothesis) and ships the
same picklable ``fn(*args)`` to every rank; each rank's return value (or its traceback) comes back in rank
order.  A hang is a failure, and fails fast:

- a rank that dies (killed, a C++ abort) is seen by ``torch.multiprocessing``'s ``ProcessContext.join`` (the
  machinery ``shardtensor.launch.spawn_ranks`` uses) within a second: the pool is killed and the call raises,
  naming the rank and its exit signal or code;
- a rank whose ``fn`` raised leaves the others ``FAILURE_GRACE_S`` to finish (they may be blocked in a
  collective with it); then the pool is killed and the call raises with every traceback it has;
- every call has an overall timeout.

A killed pool is started afresh by the next call for that world size.

Usage (``fn`` must be a module-level function of an importable module, e.g. a test module)::

    results = run_on_ranks(2, my_case, seed, shapes)   # [result_rank0, result_rank1]
"""

from __future__ import annotations

import atexit
import os
import queue
import time
import traceback
from typing import Any, Callable

from shardtensor.launch import free_port

_POOLS: dict[int, "_Pool"] = {}
FAILURE_GRACE_S = 20.0  # after one rank's fn raised, how long the others get before the pool is killed


def _worker(rank: int, world: int, port: int, inboxes: list, outbox) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    fresh_rng = torch.get_rng_state()  # a fresh process's generator: every job starts from it (see below)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    inbox = inboxes[rank]
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        _as_a_fresh_program(fresh_rng)
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _as_a_fresh_program(fresh_rng) -> None:
    """Each job stands for a program of its own: the global generator in a fresh process's state (earlier jobs
    drew different amounts on different ranks, and shard_module refuses ranks whose weights differ), and no
    optimizer steps (and their settings) counted per group (a job whose step failed on one rank leaves the counts apart, which the
    identity check would name in the next job; see [Note: optimizer steps in the record])."""
    import torch

    from shardtensor import _comm_divergence

    torch.set_rng_state(fresh_rng)
    for pos in _comm_divergence._positions.values():
        pos.steps = pos.settings = 0


class _Pool:
    def __init__(self, world: int):
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        self.world = world
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.context = tmp.start_processes(_worker, args=(world, free_port(), self.inboxes, self.outbox),
                                           nprocs=world, join=False, daemon=True, start_method="spawn")

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        import torch.multiprocessing as tmp

        for inbox in self.inboxes:
            inbox.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        grace_end = None
        where = f"{fn.__name__} on world size {self.world}"
        while len(results) + len(failures) < self.world:
            try:
                rank, ok, value = self.outbox.get(timeout=0.5)
            except queue.Empty:
                try:
                    self.context.join(timeout=0)  # raises at once if a rank has died
                except tmp.ProcessExitedException as e:
                    self.kill()
                    raise RuntimeError(f"{where}: rank {e.error_index} died ({e}); the pool was killed"
                                       + _tracebacks(failures)) from None
                now = time.monotonic()
                if grace_end is not None and now > grace_end:
                    self.kill()
                    silent = sorted(set(range(self.world)) - set(results) - set(failures))
                    raise AssertionError(f"{where}: ranks {silent} gave no result {FAILURE_GRACE_S:.0f} s after "
                                         f"rank(s) {sorted(failures)} raised (blocked in a collective with them?); "
                                         "the pool was killed" + _tracebacks(failures))
                if now > deadline:
                    self.kill()
                    raise RuntimeError(f"{where}: timed out after {timeout:.0f} s (a hang); the pool was killed"
                                       + _tracebacks(failures))
                continue
            if ok:
                results[rank] = value
            else:
                failures[rank] = value
                grace_end = grace_end or time.monotonic() + FAILURE_GRACE_S
        if failures:
            raise AssertionError(_tracebacks(failures).lstrip())
        return [results[r] for r in range(self.world)]

    def kill(self) -> None:
        for p in self.context.processes:
            if p.is_alive():
                p.kill()
        for p in self.context.processes:
            p.join(timeout=5)
        if _POOLS.get(self.world) is self:
            _POOLS.pop(self.world)

    def close(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.context.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def _tracebacks(failures: dict) -> str:
    return "".join(f"\nrank {r}:\n{tb}" for r, tb in sorted(failures.items()))


def run_on_ranks(world: int, fn: Callable, *args, timeout: float = 240.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a gloo world of size ``world``; results in rank order."""
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = _Pool(world)
    return pool.run(fn, args, kwargs, timeout)


def run_on_ranks_then_discard(world: int, fn: Callable, *args, timeout: float = 240.0, **kwargs) -> list:
    """``run_on_ranks``, then the pool is stopped (the next call starts a fresh one): for a job that fails on one
    rank before a collective the others entered, which leaves the ranks' collective counts apart."""
    try:
        return run_on_ranks(world, fn, *args, timeout=timeout, **kwargs)
    finally:
        pool = _POOLS.pop(world, None)
        if pool is not None:
            pool.kill()


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
