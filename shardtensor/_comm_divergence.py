"""Ranks that run different collectives: named on every rank, before data moves, instead of mixed data or a hang.

A comm module (with ``_comm``): the ``torch.distributed`` calls that check identity (stalls: ``_comm_stall``).

[Note: the identity check]
Per-op gathers make every rank's collective sequence a function of what its data made it compute.  Where the data
decides which parameters a rank touches (MoE routing, skipped blocks), two ranks can meet in one collective with
different tensors: same sizes mix silently, different sizes abort in gloo's C++ (``op.preamble.length <=
op.nbytes``).  So before each data collective the ranks all-gather a seven-number record (the group's sequence
number, the collective's kind, a CRC of its label -- which names the parameter --, the element count, the
dtype, the optimizer steps this rank ran over the group's parameters and a digest of their settings, see [Note:
optimizer steps in the record]) apart from the data group, where it would queue behind prefetched gathers:
through shared memory where the ranks share a host (``_comm_mailbox``), else on a gloo group of its own
(``record_exchange``); the first record goes through the store.  Every rank receives the same records, so every
rank sees a mismatch at once and raises the same
``DivergenceError`` (after one more exchange of the full labels, so the message names both parameters), and the
data collective is never issued.  ``set_divergence_check(False)`` or ``SHARDTENSOR_DIVERGENCE_CHECK=0`` turns
it off.  CUDA (NCCL) groups skip it by default: the records travel on the CPU (the control group is gloo, so
no stream is waited on), but each check still holds every rank's host thread until all arrive, which a GPU
job that runs its host far ahead of the kernels would feel; no GPU figure exists yet to weigh that
(``SHARDTENSOR_DIVERGENCE_CHECK=1`` turns it on there).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import zlib
from typing import Optional

import torch
import torch.distributed as dist

from . import _comm_mailbox as _mailbox
from ._comm_fixes import _CALLERS, _FIX, _REPLICATED, _REPLICATED_FIX, COMPILED_FIX
from ._comm_labels import COMPILED
from ._comm_work import CollectiveError


_FIELDS = 7  # seq, kind, label crc, numel, dtype, optimizer steps, their settings; then a vote, not compared
_LABEL_BYTES = 512
class DivergenceError(CollectiveError):
    """Ranks issued different collectives (another parameter, size, kind or count): raised on every rank."""


def _env_flag(name: str) -> Optional[bool]:
    value = os.environ.get(name)
    return None if value is None else value.strip().lower() not in ("0", "false", "off", "no", "")


_enabled: Optional[bool] = _env_flag("SHARDTENSOR_DIVERGENCE_CHECK")  # None: on for CPU groups, off for CUDA


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


# ------------------------------------------------------------------------------------------- per-group positions
class _Position:
    """This rank's count of checked collectives on one group, and the last one's label (for the probes)."""

    __slots__ = ("tag", "seq", "label", "group", "steps", "settings", "named")

    def __init__(self, tag: str, group):
        self.tag, self.seq, self.label, self.steps = tag, 0, "", 0  # steps: see count_optimizer_step
        self.settings = 0  # a running digest of the hyperparameters of those steps
        self.named = False  # a step divergence was raised on this group (see take_step_record)
        self.group = group  # held, so that no later group object can reuse its id() while this count stands


_positions: dict = {}  # id(group) -> _Position
_steps_left_out = False  # see steps_left_out
_crc_cache: dict = {}
_stats = [0, 0.0]  # identity checks passed, seconds spent in them (see identity_check_stats)
_divergences = [0]  # see divergences_named


def identity_check_stats() -> dict:
    """How many identity checks this process passed and the seconds they took (what the check costs a step)."""
    return {"checks": _stats[0], "seconds": _stats[1]}


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
_transports: dict = {}  # id(data group) -> (data group, how its records travel: ``(out, inp) -> work``)
_incarnations: dict = {}  # data group name -> transports this process has built for that name


def record_exchange(group):
    """``start(out, inp) -> work``: an all-gather of ``group``'s identity records through shared memory or its
    control group, once its first exchange built one; else None (see [Note: the identity check])."""
    hit = _transports.get(id(group) if group is not None else 0)
    return hit[1] if hit is not None and hit[0] is group else None


def build_control_group(group, timeout_s: float) -> None:
    """Build ``group``'s mailbox or control group, right after the group's first identity exchange completed.

    Why apart from the data group: records there queue behind the prefetches in flight, so each check would wait
    for them and overlap would be lost.  Why then: every member has just completed the same exchange (the first,
    through the store, its wait watched by the stall probes), so all arrive here at once; a rank that diverged
    earlier never gets here.  Built from the default store under a name derived from the data group's, which
    every member shares, not registered with c10d (whose names depend on how many groups a process made).
    """
    store = _store()
    if store is None:  # no default store (a custom launcher): the records stay on the data group
        return
    pg = group if group is not None else dist.group.WORLD
    if dist.get_backend(pg) == "fake":  # one process plays every rank (torch's fake_pg): nothing to queue behind,
        return                          # and its store cannot host a real gloo group
    name = getattr(pg, "group_name", "?")
    incarnation = _incarnations.get(name, 0)
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    box = _mailbox.open_mailbox(dist.PrefixStore(f"shardtensor/mailbox/{name}/{incarnation}/", store), rank, world,
                                timeout_s)
    if (start := box.exchange if box is not None else None) is None:
        control = dist.ProcessGroupGloo(dist.PrefixStore(f"shardtensor/control/{name}/{incarnation}/", store), rank,
                                        world, datetime.timedelta(seconds=timeout_s))
        start = control._allgather_base
    _incarnations[name] = incarnation + 1  # once built: a setup that timed out is retried under its name
    _transports[id(group) if group is not None else 0] = (group, start)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store (e.g. a custom launcher): records stay on the data group, waits are plain timed waits
        return None


class StoreExchange:
    """A group's first identity exchange, through the default store (a ``Work``-like handle: ``wait(timeout)``).

    Why not on the group: until its control group exists, a record sent on the data group meets whatever the
    other ranks issue there, and a user's collective of another size (rank 1 in ``dist.all_reduce`` while rank 0
    enters ``shard_module``) aborts the process in gloo's C++ (``op.preamble.length <= op.nbytes``).  Keys in the
    store meet only our own records; a rank that never comes leaves a timed, probed wait like any collective."""

    def __init__(self, store, keys: list, mine: int, like: torch.Tensor):
        self.store, self.keys, self.like = store, keys, like
        store.set(keys[mine], like.cpu().contiguous().view(torch.uint8).numpy().tobytes())

    @classmethod
    def open(cls, group, tensor: torch.Tensor, seq: int) -> Optional["StoreExchange"]:
        pg = group if group is not None else dist.group.WORLD
        store = _store()
        if store is None or dist.get_backend(pg) == "fake":
            return None
        name = getattr(pg, "group_name", "?")
        prefix = f"shardtensor/first/{name}/{_incarnations.get(name, 0)}/{seq}/"
        return cls(store, [f"{prefix}{r}" for r in range(dist.get_world_size(pg))], dist.get_rank(pg), tensor)

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        """Polls (``store.wait`` logs a warning at each probe's timeout); raises ``TimeoutError`` at the limit."""
        seconds = 600.0 if timeout is None else timeout.total_seconds()
        deadline, pause = time.monotonic() + seconds, 0.001
        while not self.store.check(self.keys):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"wait timeout after {seconds:g} s for the store keys {self.keys}")
            time.sleep(pause)
            pause = min(2 * pause, 0.05)
        return True

    def is_completed(self) -> bool:
        return self.store.check(self.keys)

    def gathered_into(self, out: torch.Tensor) -> None:
        rows = [torch.frombuffer(bytearray(self.store.get(k)), dtype=torch.uint8) for k in self.keys]
        out.copy_(torch.cat(rows).view(self.like.dtype).view(out.shape))

# ---------------------------------------------------------------------------------------------- identity check
def check_identity(kind: str, tensor: torch.Tensor, group, label: str, all_gather, vote=True) -> tuple[int, bool]:
    """Advance this rank's position on ``group``; when the check is on, exchange the identity record and raise
    ``DivergenceError`` on every rank if any rank is about to issue something else.  Returns the sequence number
    and whether every rank voted yes: a choice all must make alike, carried beside the record (``_comm_rows``:
    is each rank's shared-memory slot free); no where the check is off."""
    pos = position(group)
    pos.seq += 1
    pos.label = label or kind
    if not divergence_check_enabled(tensor.device.type):
        return pos.seq, False
    started = time.perf_counter()
    world = dist.get_world_size(group)
    dtype_code = _crc(str(tensor.dtype))
    steps, settings = (pos.steps, pos.settings) if not _steps_left_out else (0, 0)
    mine = torch.tensor([pos.seq, _crc(_caller_mark() + kind), _crc(label), tensor.numel(), dtype_code, steps,
                         settings, int(vote)], dtype=torch.int64)
    everyone = torch.empty(world * (_FIELDS + 1), dtype=torch.int64).view(world, _FIELDS + 1)
    all_gather(everyone.view(-1), mine, group, f"identity check before {pos.label}", pos.seq)
    if torch.equal(everyone[:, :_FIELDS], mine[:_FIELDS].expand(world, _FIELDS)):
        _stats[0] += 1
        _stats[1] += time.perf_counter() - started
        return pos.seq, bool(everyone[:, _FIELDS].all())
    records = everyone[:, :_FIELDS].tolist()
    if all(r[:5] == records[0][:5] for r in records):
        _raise_step_divergence(records, group, pos)
    # Every rank holds the same records, so every rank is here: one more exchange for the full names.
    text = _describe(kind, label, tensor.numel(), tensor.dtype)
    _raise_divergence(records, text, group, pos, all_gather)


# [Note: optimizer steps in the record]
# ``opt.step()`` needs no collective, so a rank that steps once more than the others (a step skipped on a local
# NaN loss, a rank-dependent condition) updates only its own rows and nothing fails: the gathered weights then
# mix rows of two steps, silently, for the rest of the run.  Each rank counts the optimizer steps it ran over
# sharded parameters of a group (a global step post-hook, ``_misuse``) and the count rides in the identity
# record, so the next gather after such a step raises on every rank, before the mixed weights are used.  A step
# with other hyperparameters on some ranks (``if rank == 0: scheduler.step()``: each rank's rows then move by
# another learning rate) is as silent; a running digest of each step's settings rides beside the count.
def count_optimizer_step(group, settings: int = 0) -> None:
    pos = position(group)
    pos.steps += 1
    pos.settings = zlib.crc32(f"{pos.settings}:{settings}".encode()) - (1 << 31)


def step_record(group) -> tuple:
    """This rank's optimizer steps over ``group``'s sharded parameters, the digest of their settings, and whether
    a step divergence was already raised here."""
    pos = position(group)
    return pos.steps, pos.settings, pos.named


@contextlib.contextmanager
def steps_left_out():
    """Collectives whose records leave the step counts out: ``shard_module``'s plan check, which compares them
    itself (see ``take_step_record``)."""
    global _steps_left_out
    _steps_left_out = True
    try:
        yield
    finally:
        _steps_left_out = False


def take_step_record(group, records: list) -> None:
    """The ranks' step records (``step_record`` of each) differ at ``shard_module``.  After a step
    divergence already raised on every rank (a sweep or a notebook that caught the ``DivergenceError`` and built
    a fresh model and optimizer), every rank starts from rank 0's record: the fresh model's every collective
    would otherwise meet the old difference.  Any other difference is a step on some ranks only that nothing
    named yet (``if rank == 0: opt_g.step()`` before a second model is sharded): raised here, on every rank."""
    if not all(named for *_, named in records):
        pos = position(group)
        _raise_step_divergence([[0, 0, 0, 0, 0, steps, settings] for steps, settings, _ in records], group, pos)
    pos = position(group)
    pos.steps, pos.settings, pos.named = records[0][0], records[0][1], False


def _raise_step_divergence(records: list, group, pos: _Position):
    pos.named = True  # every rank raises this (they hold the same records)
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    counts = ", ".join(f"rank {ranks[r]}: {records[r][5]}" for r in range(len(records)))
    if all(r[5] == records[0][5] for r in records):
        raise DivergenceError(
            f"shardtensor rank {dist.get_rank()}: before {pos.label!r} (collective #{pos.seq} on group {pos.tag}) "
            f"the ranks have run as many optimizer steps ({counts}) but with different settings (lr, weight decay, "
            "momentum...) in some step: each rank's rows moved by another rule, and gathered weights would mix "
            "them; no data was exchanged. Fix: change the settings on every rank alike: step an LR scheduler on "
            "every rank, not under `if rank == 0:`, feed ReduceLROnPlateau a metric all-reduced across ranks (not "
            "each rank's own loss), and edit param_groups on every rank.")
    raise DivergenceError(
        f"shardtensor rank {dist.get_rank()}: before {pos.label!r} (collective #{pos.seq} on group {pos.tag}) the "
        f"ranks have run different numbers of optimizer steps over the group's sharded parameters ({counts}): an "
        "opt.step() ran on some ranks only, so each rank's rows are at another step and gathered weights would "
        "mix them (or a rank with fewer steps is still in code the others skipped, such as an evaluation under "
        "`if rank == 0:` or one more micro-batch than the others, while they went on to their step); no data was "
        "exchanged. Fix: step on every rank alike, run as many micro-batches per step on every rank (pad the last "
        "batch, or drop_last=True), and run code that reads sharded parameters on every rank; a step skipped on "
        "a rank-local condition "
        "(a NaN loss on one rank) must be skipped everywhere: all-reduce the condition first "
        "(dist.all_reduce(flag, op=dist.ReduceOp.MAX)), or let torch.amp.GradScaler skip it (its skips agree).")


def divergences_named() -> int:
    """How many ``DivergenceError``s of mismatched collectives this process raised (every rank raises each one):
    a Gatherer that sees the count move forgets the gather order it recorded (see ``Gatherer._begin_step``)."""
    return _divergences[0]


def _caller_mark() -> str:
    """The mark of a call in ``_CALLERS`` on the stack (``generate``), else "".  It rides in the identity record:
    a rank out of ``generate()`` whose next collectives looked like its peer's gathers inside it (the same
    parameters in the same order: ``full_state_dict``, an evaluation) exchanged data with them unnoticed, and
    waited at its next barrier until the collective timeout (helper J: 600 s, naming no fix)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        for function, file_part, marker, _ in _CALLERS:
            if code.co_name == function and file_part in code.co_filename:
                return marker
        frame = frame.f_back
    return ""


def _raise_divergence(records: list, text: str, group, pos: _Position, all_gather):
    _divergences[0] += 1
    world = len(records)
    text = _caller_mark() + text  # so a rank already out of that call names the fix too
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
        f"exchanged.\n" + "\n".join(lines) + f"\n{_REPLICATED_FIX if any(_REPLICATED in t for t in texts) else _FIX}"
        + "".join(fix for _, _, marker, fix in _CALLERS if any(marker in t for t in texts))
        + (COMPILED_FIX if 0 < sum(COMPILED in t for t in texts) < world else "")
    )
