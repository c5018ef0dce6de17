"""Ranks blocked in collectives that cannot complete: named on every rank, instead of a hang.

A comm module (with ``_comm`` and ``_comm_divergence``): the store reads and writes that watch a wait.

[Note: stall probes]
A rank that stops issuing collectives leaves the others waiting.  CPU waits are split: after
``probe_interval()`` seconds (``SHARDTENSOR_DIVERGENCE_PROBE_S``, default 3) the waiting rank publishes its
position (group, sequence number, label) under a per-rank key of the default store (TCPStore: no collective
needed) and reads the others'.  It raises ``DivergenceError`` only on proof: every other rank of the group is
itself blocked, over a probe interval, where it cannot progress while this one waits (another sequence number
or label of this group, or a collective of another group that this rank has not issued), or another rank
already failed while this one waited; and it raises ``CollectiveError`` where another rank's process, on this
host, is gone (killed, or its script ended: shared memory, unlike a socket, tells no one).  A rank that is merely busy
elsewhere (rank 0 writing a checkpoint alone) is not proof: this rank then logs a warning naming both positions
and keeps waiting up to ``collective_timeout()``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import time
from typing import Optional

import torch.distributed as dist

from ._comm_divergence import DivergenceError, _Position, _positions, _store, positive_seconds
from ._comm_work import CollectiveError
from ._comm_fixes import _FIX

log = logging.getLogger("shardtensor")

_probe_s: float = float(os.environ.get("SHARDTENSOR_DIVERGENCE_PROBE_S", "3"))
_last_progress = time.time()  # when a wait of this rank last completed


def set_probe_interval(seconds: float) -> float:
    """Seconds a CPU collective waits before the ranks compare positions (see [Note: stall probes])."""
    global _probe_s
    previous, _probe_s = _probe_s, positive_seconds("set_probe_interval", seconds)
    return previous


def probe_interval() -> float:
    return _probe_s


def _key(global_rank: int) -> str:
    return f"shardtensor/position/{global_rank}"


def _publish(store, record: dict) -> None:
    try:
        store.set(_key(dist.get_rank()), json.dumps(record))
    except Exception:  # noqa: BLE001 - probes are advisory; the timed wait still bounds the hang
        pass


def _read(store, global_rank: int) -> Optional[dict]:
    return _read_key(store, _key(global_rank))


def _read_key(store, key: str) -> Optional[dict]:
    try:
        if not store.check([key]):
            return None
        return json.loads(store.get(key))
    except Exception:  # noqa: BLE001
        return None


_reset_record = [False]  # this rank published "failed" or "waiting": its next completed wait says "running"
_published: dict = {}  # id of the default store this process published its pid in -> True
_processes: dict = {}  # (id of the default store, global rank) -> (host and pid namespace, pid) last read


def _where_pids_live() -> Optional[str]:
    """This host and pid namespace (two containers may share a host name, not their pids); None off Linux."""
    try:
        return f"{socket.gethostname()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


_HERE = _where_pids_live()


def publish_process() -> None:
    """This rank's host and pid, once per process (at a group's first exchange, where every rank is): a rank
    waiting on it through shared memory, which no dead process closes, can then tell that it is gone."""
    if _HERE is None or not dist.is_initialized() or (store := _store()) is None or id(store) in _published:
        return
    try:
        store.set(f"shardtensor/process/{dist.get_rank()}", json.dumps({"where": _HERE, "pid": os.getpid()}))
        _published[id(store)] = True
    except Exception:  # noqa: BLE001 - advisory, as the probes are
        pass


def _gone(store, global_rank: int) -> Optional[int]:
    """The pid of ``global_rank``'s process where it ran beside this one (host and pid namespace) and has ended
    (exited or killed: gone, or a zombie its launcher has not reaped yet); None otherwise.  Keyed by the store:
    a process that starts another world (init_process_group again) must not take an old peer's pid for a new one."""
    key = (id(store), global_rank)
    record = _read_key(store, f"shardtensor/process/{global_rank}")  # (kept for when the store's host is gone)
    if record:
        _processes[key] = (record["where"], record["pid"])
    where_pid = _processes.get(key)
    if where_pid is None or where_pid[0] != _HERE:
        return None
    try:
        with open(f"/proc/{where_pid[1]}/stat") as f:
            return where_pid[1] if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X") else None
    except FileNotFoundError:
        return where_pid[1]
    except (OSError, IndexError):
        return None


def publish_failure(message: str) -> None:
    """Tell the other ranks that this one gave up (they stop waiting for it; see [Note: stall probes])."""
    store = _store() if dist.is_initialized() else None
    if store is not None:
        _publish(store, {"state": "failed", "time": time.time(), "message": message[:2000]})
        _reset_record[0] = True


def _progressed(store) -> None:
    """A wait of this rank completed: a failure it published earlier is over (the ranks went on after it), so a
    rank probing later must not take it for the current one."""
    global _last_progress
    _last_progress = time.time()
    if _reset_record[0]:
        _reset_record[0] = False
        store = store if store is not None else _store()
        if store is not None:
            _publish(store, {"state": "running", "time": _last_progress})


def _timed_out(exc: BaseException) -> bool:
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def wait_watched(work, seconds: float, group, pos: _Position, what: str) -> None:
    """``work.wait`` limited to ``seconds``, comparing positions with the other ranks every probe interval.

    Raises ``DivergenceError`` on proof of divergence, and lets the backend's timeout error through otherwise.
    """
    deadline = time.monotonic() + seconds
    first = min(_probe_s, seconds)
    try:
        work.wait(timeout=datetime.timedelta(seconds=first))
        _progressed(None)
        return
    except Exception as exc:  # noqa: BLE001 - a timeout (probe), else a real failure: raised at once
        if time.monotonic() >= deadline or not _timed_out(exc):
            raise
    store = _store()
    mine = {"state": "waiting", "group": pos.tag, "seq": pos.seq, "label": what, "since": time.time(), "probe": 0,
            "ranks": dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)}
    seen: dict = {}
    warned_at = 0.0
    while True:
        if store is not None:
            mine["probe"] += 1
            _publish(store, mine)
            warned_at = _compare(store, group, mine, seen, warned_at)
        left = deadline - time.monotonic()
        if left <= 0:
            work.wait(timeout=datetime.timedelta(milliseconds=1))  # raises the backend's timeout unless done
            break
        try:
            work.wait(timeout=datetime.timedelta(seconds=min(_probe_s, left)))
            break
        except Exception as exc:  # noqa: BLE001
            if time.monotonic() >= deadline or not _timed_out(exc):
                raise
    _reset_record[0] = True  # the record says "waiting": _progressed overwrites it
    _progressed(store)


def _where(record: Optional[dict]) -> str:
    outside = ("computing, or blocked outside shardtensor, e.g. in dist.barrier() while this rank runs a forward, "
               "an eval or full_state_dict that the other ranks skip: every rank must run those")
    if record is None:
        return f"has published no position: it has not waited long at any shardtensor collective ({outside})"
    if record.get("state") == "waiting":
        return f"waits at collective #{record['seq']} on group {record['group']}: {record['label']}"
    return f"is not waiting at any shardtensor collective (state {record.get('state')!r}; {outside})"


def _waits_on_me(rec: dict, mine: dict) -> bool:
    """Whether a rank blocked at ``rec`` cannot progress while this rank stays blocked at ``mine``: it waits in
    this group at another position, or in a group of this rank's at a collective this rank has not issued yet
    (a rank waiting in a group this rank is not in may be waiting for a third, slow rank: no proof)."""
    if rec["group"] == mine["group"]:
        return (rec["seq"], rec["label"]) != (mine["seq"], mine["label"])
    if dist.get_rank() not in rec.get("ranks", ()):
        return False
    # This rank's count there (the newest group under that name; 0 if it never used the group): a member that has
    # not issued the collective the other waits at.
    issued = [pos.seq for pos in list(_positions.values()) if pos.tag == rec["group"]]
    return (issued[-1] if issued else 0) < rec["seq"]


def _compare(store, group, mine: dict, seen: dict, warned_at: float) -> float:
    """One probe: raise on proof of divergence (see [Note: stall probes]); warn otherwise.  Returns when it last
    warned."""
    me = dist.get_rank()
    others = [r for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD) if r != me]
    records = {r: _read(store, r) for r in others}
    for r in others:
        pid = _gone(store, r)
        if pid is not None:
            message = (f"shardtensor rank {me}: waiting at collective #{mine['seq']} on group {mine['group']} "
                       f"({mine['label']}), but rank {r}'s process (pid {pid}) is gone: killed (out of memory?) or "
                       "its script ended (a rank with fewer batches than the others, code after the loop that only "
                       "some ranks run). Fix: give every rank the same number of steps (drop or pad the last "
                       "batches, e.g. DistributedSampler(drop_last=True)), and run evaluations on every rank.")
            publish_failure(message)
            raise CollectiveError(message)
    for r, rec in records.items():
        # A failure older than this rank's last completed wait is over where that rank went on: its next completed
        # wait, or its own probe, overwrites the record.  One still there a probe later did not go on (this rank
        # saw its last wait complete late: the peer had posted its part, then failed).
        failed_at = rec.get("time", 0) if rec and rec.get("state") == "failed" else None
        stale_twice, seen[("failed", r)] = failed_at is not None and seen.get(("failed", r)) == failed_at, failed_at
        if failed_at is not None and (failed_at > _last_progress or stale_twice):
            message = (f"shardtensor rank {me}: waiting at collective #{mine['seq']} on group {mine['group']} "
                       f"({mine['label']}), but rank {r} already failed:\n  {rec.get('message', '')}\n{_FIX}")
            publish_failure(message)  # a third rank waiting on this one learns it too
            raise DivergenceError(message)
    blocked_elsewhere = []
    for r, rec in records.items():
        previous, seen[r] = seen.get(r), rec
        if not (rec and previous and rec.get("state") == "waiting" and previous.get("state") == "waiting"):
            continue
        same_wait = rec["since"] == previous["since"] and rec["probe"] > previous["probe"]
        if same_wait and _waits_on_me(rec, mine):
            blocked_elsewhere.append(r)
    if others and len(blocked_elsewhere) == len(others):
        lines = [f"  rank {me} waits at collective #{mine['seq']} on group {mine['group']}: {mine['label']}"]
        lines += [f"  rank {r} {_where(records[r])}" for r in others]
        message = (f"shardtensor rank {me}: ranks diverged: each is blocked in a different collective and none "
                   f"can complete.\n" + "\n".join(lines) + f"\n{_FIX}")
        publish_failure(message)
        raise DivergenceError(message)
    now = time.monotonic()
    # Quiet for the first half minute: a rank that is merely slower (first-step compilation, a loaded host) is
    # normal, and a warning at every short wait reads like an error.
    if (now - warned_at >= 60.0) if warned_at else (time.time() - mine["since"] >= 30.0):
        lines = "; ".join(f"rank {r} {_where(records[r])}" for r in others)
        log.warning("shardtensor rank %d: waiting at collective #%d on group %s (%s); %s. A rank that never "
                    "issues this collective is a divergence (see DivergenceError); a busy rank is fine.",
                    me, mine["seq"], mine["group"], mine["label"], lines)
        return now
    return warned_at
