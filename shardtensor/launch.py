"""Starting gloo worlds on one machine (the demo, the benchmarks, the tests): one launcher that never hangs.

``spawn_ranks`` runs one function on N freshly spawned ranks and returns each rank's return value.  If a rank
raises, or dies (killed, out of memory, a C++ abort), the parent stops the other ranks at once and raises
:class:`RankFailed` naming that rank and carrying its traceback or exit signal: a failed rank never leaves the
parent waiting on ranks that are blocked in a collective with it.  The watching is torch's own
(``torch.multiprocessing.start_processes`` and ``ProcessContext.join``); results travel through one file per
rank, written after the rank's function returns, so no queue can block the parent.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, Optional


class RankFailed(RuntimeError):
    """A spawned rank raised, died or overran the launcher's timeout; ``rank`` is its index (None on timeout)."""

    def __init__(self, message: str, rank: Optional[int] = None):
        super().__init__(message)
        self.rank = rank


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it), for ``MASTER_PORT``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_rank(rank: int, worker: Callable, world: int, port: int, args: tuple, out_dir: str) -> None:
    """One spawned rank: run the worker, then hand its result to the parent through ``out_dir``."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    if isinstance(args, bytes):
        args = pickle.loads(args)
    try:
        result = worker(rank, world, port, *args)
    except BaseException:  # when it failed, so the parent can name the first failure, not its echo on a peer
        with open(os.path.join(out_dir, f"rank{rank}.failed"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".tmp", path)  # a rank killed mid-write leaves no half file behind


def spawn_ranks(worker: Callable, world: int, *args: Any, timeout: Optional[float] = None) -> list:
    """Run ``worker(rank, world, port, *args)`` in ``world`` spawned processes; their return values in rank order.

    ``worker`` must be a module-level function (it is pickled into the spawned ranks) and its return value
    picklable.  ``port`` is a free port for ``MASTER_PORT`` (also set in each rank's environment with
    ``MASTER_ADDR=127.0.0.1``), so a worker can call ``dist.init_process_group("gloo", rank=rank,
    world_size=world)``.  Spawned, not forked: each rank starts with a clean torch and reads its environment
    (e.g. ``MALLOC_MMAP_THRESHOLD_``) at start.  Each rank gets its own copy of ``args``, tensors included, as
    separate processes do (``torch.multiprocessing`` alone would share a tensor's memory between the ranks and
    the caller).

    Raises :class:`RankFailed` as soon as one rank raises or exits without a result (the others are stopped),
    or when ``timeout`` seconds pass (all ranks are killed).
    """
    import torch.multiprocessing as mp

    deadline = None if timeout is None else time.monotonic() + timeout
    try:  # each rank unpickles its own copy: torch.multiprocessing would share tensors' memory between the ranks
        packed: Any = pickle.dumps(args)  # and the parent (an optimizer's step counter stepped by every rank)
    except Exception:  # noqa: BLE001 - something only torch.multiprocessing can send: sent as it is
        packed = args
    with tempfile.TemporaryDirectory(prefix="shardtensor-ranks-") as out_dir:
        context = mp.start_processes(_run_rank, args=(worker, world, free_port(), packed, out_dir), nprocs=world,
                                     join=False, start_method="spawn")
        try:
            while not context.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    raise RankFailed(f"{_name(worker)} on {world} ranks: no result after {timeout:.0f} s "
                                     "(a hang); every rank was killed")
        except mp.ProcessRaisedException as e:
            rank, text = _first_failure(out_dir, world, e.error_index, str(e))
            raise RankFailed(f"{_name(worker)}: rank {rank} of {world} raised:\n{text}", rank) from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"{_name(worker)}: rank {e.error_index} of {world} died (exit code {e.exit_code}"
                             f"{', signal ' + e.signal_name if e.signal_name else ''}) before returning a result; "
                             "the other ranks were stopped", e.error_index) from None
        finally:
            for p in context.processes:  # only on the error paths is one still alive
                if p.is_alive():
                    p.kill()
                    p.join(5)
        results = []
        for rank in range(world):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):  # exit code 0 without returning: os._exit(0) or sys.exit(0) in the worker
                raise RankFailed(f"{_name(worker)}: rank {rank} of {world} exited (code 0) without returning a result",
                                 rank)
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        return results


def _first_failure(out_dir: str, world: int, reported: int, text: str) -> tuple:
    """The rank that raised first, and its traceback.  A rank that raises makes its peers' collectives fail too
    ("Connection closed by peer"), and torch reports whichever failed rank it notices first; the cause is the
    earliest.  Peers still failing get a moment to write their time down."""
    time.sleep(0.5)
    failures = []
    for rank in range(world):
        try:
            with open(os.path.join(out_dir, f"rank{rank}.failed")) as f:
                when, _, trace = f.read().partition("\n")
            failures.append((float(when), rank, trace))
        except (OSError, ValueError):
            continue
    if not failures:
        return reported, text
    _, rank, trace = min(failures)
    return rank, trace


def _name(worker: Callable) -> str:
    return getattr(worker, "__qualname__", repr(worker))


def run_or_exit(worker: Callable, world: int, *args: Any, timeout: Optional[float] = None) -> list:
    """:func:`spawn_ranks` for command-line entry points: a failed rank ends the program with its error, code 1."""
    try:
        return spawn_ranks(worker, world, *args, timeout=timeout)
    except RankFailed as e:
        raise SystemExit(f"error: {e}") from None
