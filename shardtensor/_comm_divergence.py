"""Ranks that run different collectives: named on every rank, before data moves, instead of mixed data or a hang.

A comm module (with ``_comm``): the ``torch.distributed`` calls that check identity and watch for stalls.

[Note: the identity check]
Per-op gathers make every rank's collective sequence a function of what its data made it compute.  Where the data
decides which parameters a rank touches (MoE routing, skipped blocks), two ranks can meet in one collective with
different tensors: same sizes mix silently, different sizes abort in gloo's C++ (``op.preamble.length <=
op.nbytes``).  So before each data collective the ranks all-gather a five-number record (the group's sequence
number, the collective's kind, a CRC of its label -- which names the parameter --, the element count and the
dtype) on a gloo control group of the data group's own (``control_group``), where it does not queue behind the
gathers already prefetched on the data group.  Every rank receives the same records, so every rank sees a mismatch at once and raises the same
``DivergenceError`` (after one more exchange of the full labels, so the message names both parameters), and the
data collective is never issued.  ``set_divergence_check(False)`` or ``SHARDTENSOR_DIVERGENCE_CHECK=0`` turns
it off.  CUDA (NCCL) groups skip it by default: the records travel on the CPU (the control group is gloo, so
no stream is waited on), but each check still holds every rank's host thread until all arrive, which a GPU
job that runs its host far ahead of the kernels would feel; no GPU figure exists yet to weigh that
(``SHARDTENSOR_DIVERGENCE_CHECK=1`` turns it on there).

[Note: stall probes]
A rank that stops issuing collectives leaves the others waiting.  CPU waits are split: after
``probe_interval()`` seconds (``SHARDTENSOR_DIVERGENCE_PROBE_S``, default 3) the waiting rank publishes its
position (group, sequence number, label) under a per-rank key of the default store (TCPStore: no collective
needed) and reads the others'.  It raises ``DivergenceError`` only on proof: every other rank of the group is
itself blocked, over a probe interval, where it cannot progress while this one waits (another sequence number
or label of this group, or a collective of another group that this rank has not issued), or another rank
already failed while this one waited.  A rank that is merely busy
elsewhere (rank 0 writing a checkpoint alone) is not proof: this rank then logs a warning naming both positions
and keeps waiting up to ``collective_timeout()``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from ._comm_work import CollectiveError

log = logging.getLogger("shardtensor")

_FIELDS = 5  # seq, kind, label crc, numel, dtype
_LABEL_BYTES = 512
_FIX = (
    "Every rank must run the same ops on sharded parameters, in the same order. A submodule whose use depends on "
    "the data (mixture-of-experts experts called only for routed tokens, blocks skipped or repeated per rank) "
    "must gather the same on every rank: make the module that holds the experts a gather unit "
    "(shard_module(..., units=[ExpertsModuleClass]): its parameters are gathered and reduced together, whatever "
    "the data), call every expert on every rank (with zero tokens if none is routed to it), or keep "
    "such parameters whole on every rank (shard_module(..., persist_numel=N) with N above the parameters' full "
    "numel, not the shard sizes named above). "
    "set_divergence_check(False) turns this check off."
)


class DivergenceError(CollectiveError):
    """Ranks issued different collectives (another parameter, size, kind or count): raised on every rank."""


def _env_flag(name: str) -> Optional[bool]:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() not in ("0", "false", "off", "no", "")


_enabled: Optional[bool] = _env_flag("SHARDTENSOR_DIVERGENCE_CHECK")  # None: on for CPU groups, off for CUDA
_probe_s: float = float(os.environ.get("SHARDTENSOR_DIVERGENCE_PROBE_S", "3"))


def set_divergence_check(enabled: bool) -> bool:
    """Turn the cross-rank identity check before every collective on or off (every rank alike); returns the
    previous setting.  Why it exists: see [Note: the identity check]; it costs one tiny all-gather per collective."""
    global _enabled
    previous = divergence_check_enabled()
    _enabled = bool(enabled)
    return previous


def divergence_check_enabled(device_type: str = "cpu") -> bool:
    return _enabled if _enabled is not None else device_type == "cpu"


def positive_seconds(setter: str, seconds: float) -> float:
    """``seconds`` as a float, or a ValueError naming the setter (shared by the timeout and the probe interval)."""
    seconds = float(seconds)
    if not seconds > 0:
        raise ValueError(f"{setter}: {seconds=}; expected a positive number of seconds")
    return seconds


def set_probe_interval(seconds: float) -> float:
    """Seconds a CPU collective waits before the ranks compare positions (see [Note: stall probes])."""
    global _probe_s
    previous, _probe_s = _probe_s, positive_seconds("set_probe_interval", seconds)
    return previous


def probe_interval() -> float:
    return _probe_s


# ------------------------------------------------------------------------------------------- per-group positions
class _Position:
    """This rank's count of checked collectives on one group, and the last one's label (for the probes)."""

    __slots__ = ("tag", "seq", "label", "group")

    def __init__(self, tag: str, group):
        self.tag, self.seq, self.label = tag, 0, ""
        self.group = group  # held, so that no later group object can reuse its id() while this count stands


_positions: dict = {}  # id(group) -> _Position
_crc_cache: dict = {}
_stats = [0, 0.0]  # identity checks passed, seconds spent in them (see identity_check_stats)


def identity_check_stats() -> dict:
    """How many identity checks this process passed and the seconds they took (what the check costs a step)."""
    return {"checks": _stats[0], "seconds": _stats[1]}
_last_progress = time.time()  # when a wait of this rank last completed


def _group_tag(group) -> str:
    """A name every member gives the group (c10d names groups in creation order), and its ranks."""
    pg = group if group is not None else dist.group.WORLD
    ranks = ",".join(map(str, dist.get_process_group_ranks(pg)))
    return f"{getattr(pg, 'group_name', '?')} (ranks {ranks})"


def position(group) -> _Position:
    key = id(group) if group is not None else 0
    pos = _positions.get(key)
    if pos is None:
        pos = _positions[key] = _Position(_group_tag(group), group)
    return pos


def _crc(text: str) -> int:
    value = _crc_cache.get(text)
    if value is None:
        if len(_crc_cache) > 100_000:
            _crc_cache.clear()
        value = _crc_cache[text] = zlib.crc32(text.encode())
    return value


def _describe(kind: str, label: str, numel: int, dtype: torch.dtype) -> str:
    return f"{label or kind} [{kind}, {numel} elements of {dtype} on this rank's side of the collective]"


# ----------------------------------------------------------------------------------------------- control groups
_controls: dict = {}  # id(data group) -> (data group, its control group)
_incarnations: dict = {}  # data group name -> control groups this process has built for that name


def control_group(group):
    """The gloo group that carries ``group``'s identity records once built (see [Note: the identity check]),
    else None: the records then travel on ``group`` itself."""
    hit = _controls.get(id(group) if group is not None else 0)
    return hit[1] if hit is not None and hit[0] is group else None


def build_control_group(group, timeout_s: float) -> None:
    """Build ``group``'s control group, right after the group's first identity exchange completed.

    Why a second group: records sent on the data group queue behind the prefetches already in flight there, so
    every check would wait for the gathers before it and overlap would be lost.  Why then: every member has
    just completed the same exchange (the first one, on the data group, where a wait is watched by the stall
    probes), so every member arrives here at once; a rank that diverged earlier never gets here.  Built straight
    from the default store under a name derived from the data group's, which every member shares, and not
    registered with c10d, whose names for new groups depend on how many groups each process has made.
    """
    store = _store()
    if store is None:  # no default store (a custom launcher): the records stay on the data group
        return
    pg = group if group is not None else dist.group.WORLD
    if dist.get_backend(pg) == "fake":  # one process plays every rank (torch's fake_pg): nothing to queue behind,
        return                          # and its store cannot host a real gloo group
    name = getattr(pg, "group_name", "?")
    incarnation = _incarnations.get(name, 0)
    prefix = dist.PrefixStore(f"shardtensor/control/{name}/{incarnation}/", store)
    control = dist.ProcessGroupGloo(prefix, dist.get_rank(pg), dist.get_world_size(pg),
                                    datetime.timedelta(seconds=timeout_s))
    _incarnations[name] = incarnation + 1  # counted once built: a setup that timed out is retried under its name
    _controls[id(group) if group is not None else 0] = (group, control)


# ---------------------------------------------------------------------------------------------- identity check
def check_identity(kind: str, tensor: torch.Tensor, group, label: str, all_gather) -> int:
    """Advance this rank's position on ``group``; when the check is on, exchange the identity record and raise
    ``DivergenceError`` on every rank if any rank is about to issue something else.  Returns the sequence number."""
    pos = position(group)
    pos.seq += 1
    pos.label = label or kind
    if not divergence_check_enabled(tensor.device.type):
        return pos.seq
    started = time.perf_counter()
    world = dist.get_world_size(group)
    dtype_code = _crc(str(tensor.dtype))
    mine = torch.tensor([pos.seq, _crc(kind), _crc(label), tensor.numel(), dtype_code], dtype=torch.int64)
    everyone = torch.empty(world * _FIELDS, dtype=torch.int64)
    all_gather(everyone, mine, group, f"identity check before {pos.label}", pos.seq)
    if torch.equal(everyone.view(world, _FIELDS), mine.expand(world, _FIELDS)):
        _stats[0] += 1
        _stats[1] += time.perf_counter() - started
        return pos.seq
    # Every rank holds the same records, so every rank is here: one more exchange for the full names.
    text = _describe(kind, label, tensor.numel(), tensor.dtype)
    _raise_divergence(everyone.view(world, _FIELDS).tolist(), text, group, pos, all_gather)


def _raise_divergence(records: list, text: str, group, pos: _Position, all_gather):
    world = len(records)
    encoded = text.encode()[:_LABEL_BYTES]
    mine = torch.zeros(_LABEL_BYTES, dtype=torch.uint8)
    mine[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    everyone = torch.empty(world * _LABEL_BYTES, dtype=torch.uint8)
    all_gather(everyone, mine, group, "exchanging names after a divergence", pos.seq)
    rows = everyone.cpu().view(world, _LABEL_BYTES)
    texts = [bytes(rows[r].tolist()).rstrip(b"\0").decode(errors="replace") for r in range(world)]
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = dist.get_rank(group)
    lines = [f"  rank {ranks[r]}: collective #{records[r][0]}: {texts[r]}" for r in range(world)]
    odd = [r for r in range(world) if records[r] != records[me]]
    first = odd[0] if odd else me
    raise DivergenceError(
        f"shardtensor rank {ranks[me]}: ranks diverged at collective #{pos.seq} on group {pos.tag}: rank "
        f"{ranks[me]} is about to run {texts[me]!r} but rank {ranks[first]} runs {texts[first]!r}; no data was "
        f"exchanged.\n" + "\n".join(lines) + f"\n{_FIX}"
    )


# -------------------------------------------------------------------------------------------------- stall probes
def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (e.g. a custom launcher): waits are plain timed waits
        return None


def _key(global_rank: int) -> str:
    return f"shardtensor/position/{global_rank}"


def _publish(store, record: dict) -> None:
    try:
        store.set(_key(dist.get_rank()), json.dumps(record))
    except Exception:  # noqa: BLE001 - probes are advisory; the timed wait still bounds the hang
        pass


def _read(store, global_rank: int) -> Optional[dict]:
    try:
        if not store.check([_key(global_rank)]):
            return None
        return json.loads(store.get(_key(global_rank)))
    except Exception:  # noqa: BLE001
        return None


_reset_record = [False]  # this rank published "failed" or "waiting": its next completed wait says "running"


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
    for r, rec in records.items():
        # A failure older than this rank's last completed wait is over: that rank went on to complete it.
        if rec and rec.get("state") == "failed" and rec.get("time", 0) > _last_progress:
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
