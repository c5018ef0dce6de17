"""A pool of gloo worker processes per world size, started once per pytest session.

Why: starting a process that imports torch costs seconds; a property test with 20 examples x 3 world sizes
cannot afford fresh processes per example.  The pytest process draws the example (hypothesis) and ships the
same picklable ``fn(*args)`` to every rank; each rank's return value (or its traceback) comes back in rank
order.  A hang is a failure: every call has a timeout, and a dead worker is reported with its exit code.

Usage (``fn`` must be a module-level function of an importable module, e.g. a test module)::

    results = run_on_ranks(2, my_case, seed, shapes)   # [result_rank0, result_rank1]
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable

_POOLS: dict[int, "_Pool"] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inbox, outbox) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=90))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the test
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _Pool:
    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world = world
        self.inboxes = [ctx.Queue() for _ in range(world)]
        self.outbox = ctx.Queue()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world, port, self.inboxes[r], self.outbox), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        for inbox in self.inboxes:
            inbox.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        failures: list[str] = []
        waited = 0.0
        while len(results) + len(failures) < self.world:
            try:
                rank, ok, value = self.outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or waited > timeout:
                    self.kill()
                    why = f"ranks {dead} died" if dead else f"timed out after {timeout:.0f}s (a hang)"
                    raise RuntimeError(f"{fn.__name__} on world size {self.world}: {why}; failures: {failures}")
                continue
            if ok:
                results[rank] = value
            else:
                failures.append(f"rank {rank}:\n{value}")
        if failures:
            raise AssertionError("\n".join(failures))
        return [results[r] for r in range(self.world)]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        _POOLS.pop(self.world, None)

    def close(self) -> None:
        for inbox in self.inboxes:
            try:
                inbox.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def run_on_ranks(world: int, fn: Callable, *args, timeout: float = 240.0, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a gloo world of size ``world``; results in rank order."""
    pool = _POOLS.get(world)
    if pool is None:
        pool = _POOLS[world] = _Pool(world)
    return pool.run(fn, args, kwargs, timeout)


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()
