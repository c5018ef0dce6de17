"""Starting gloo worlds on one machine (the demo, the benchmarks): one place for the rendezvous port."""

from __future__ import annotations

import socket
from typing import Any, Callable, Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable, world: int, *args: Any, join_timeout: Optional[float] = None,
                check_exit: bool = True) -> list:
    """Run ``worker(rank, world, port, *args, queue)`` in ``world`` fresh processes; each puts one result.

    Results come back in arrival order (callers sort them).  ``check_exit=False`` leaves a failed rank to the
    caller (whose worker reports its error as its result).  Spawned, not forked: each rank starts with a clean
    torch and reads its environment (e.g. ``MALLOC_MMAP_THRESHOLD_``) at start.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join(timeout=join_timeout)
        if check_exit and p.exitcode:
            raise SystemExit(f"a rank exited with code {p.exitcode}")
    return results
