"""What a script writes into a sharded ``.grad`` between ``no_sync`` micro-batches, applied to the gradient that
waits aside.

[Note: edits of a gradient between no_sync micro-batches]
Under DDP, ``.grad`` holds this rank's summed gradient between ``no_sync`` micro-batches, and whatever a script
does to it there is done to that sum before the synced backward averages it: ``opt.zero_grad()`` (an epoch's
incomplete accumulation, a skipped NaN batch) throws it away, ``p.grad.mul_(s)`` scales it, ``p.grad.copy_(x)``
or ``p.grad = x`` replaces it.  A sharded parameter keeps that sum aside instead (a full tensor in
``GradSync._deferred``) and its ``.grad`` holds a zero placeholder shard, so each of those writes lands on the
placeholder and, unseen, left the sum to be reduced as it was: silently wrong numbers.  So the writes are watched
where they happen, in the op table, and the sum is brought up to date before it is next used:

- zeros over a whole shard (``zero_``, ``_foreach_zero_``, ``fill_(0)``, ``p.grad[:] = 0``) stamp the shard
  (``note_overwritten``): a deferral older than the stamp is thrown away.  ``.grad.data`` and ``detach()`` share
  the shard, so writes through them count; a write through a row view (``grad[pad].zero_()``) does not;
- a scale by a scalar over a whole shard (``mul_``, ``div_``, ``_foreach_mul_``; ``clip_grad_norm_``'s
  coefficient) is logged on the shard that holds a deferral and applied to the sum.  The end of each deferring
  backward gives the shards of the parameters it deferred an empty log (``remember_holder``: after
  AccumulateGrad, which replaces ``.grad`` under ``create_graph``); a parameter that backward did not reach (an
  expert skipped, a reentrant checkpoint's inner backward) keeps its log.

Anything else a script does with such a ``.grad`` outside a backward is refused with ``ShardedOpError`` naming
the parameter (``refusal_of_use_of_pending``; ``refuse_read_of_pending`` for ``to_local()``, ``full_tensor()``
and ``to_dtensor()``, which reach the shard without the op table): a read (a clip's norm, ``nan_to_num``, ``clone()``, logging a norm),
a write through a row view, a fill with another value, a ``copy_`` into it.  Each of them computed on the
placeholder's zeros where DDP computes on this rank's sum, and the results differed from DDP silently: a clip
by norm or value that binds under DDP did nothing, ``p.grad = p.grad / 2`` kept the sum unscaled,
``p.grad.copy_(x)`` kept it instead of replacing it.  (A first attempt took a ``copy_`` or a new ``.grad`` for a
replacement and threw the sum away under ``p.grad = p.grad.clone()``: helper F; that read is refused now.)
Views (``.data``, ``detach()``, ``grad[i]``) and metadata pass, and so does the backward's own work on
``.grad`` (AccumulateGrad adding the next placeholder), told by the autograd engine's running graph task.

``None`` in ``.grad`` means ``zero_grad(set_to_none=True)`` ran (a deferring backward leaves the placeholder).
A kept-whole parameter defers nothing: its ``.grad`` sums this rank's gradients as under DDP (see [Note:
replicated gradients] in reduce.py), so every write into it is what DDP sees.  A read of ``.grad`` there (a clip's
norm) sees DDP's local sum.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

from ._errors import ShardedOpError

_clock = itertools.count(1)
_OVERWRITTEN_AT = "_shardtensor_overwritten_at"
_SCALES = "_shardtensor_scales"  # on a shard holding a deferral: [(factor, divide), ...] written since
_NAME = "_shardtensor_deferred_name"  # on a shard holding a deferral: its parameter's name, for refusals
_LOGGING: dict[int, weakref.ref] = {}  # id -> the shards that carry a scale log (tensors do not hash by id)


def logging_scales() -> bool:
    """Whether any shard holds a deferral (else a scale needs no note: the common case, an optimizer step)."""
    return bool(_LOGGING)


def deferral_stamp() -> int:
    """A time for a deferral: an overwrite stamped later throws it away."""
    return next(_clock)


def note_overwritten(tensors) -> None:
    """Zeros were written over each of ``tensors`` (whole shards; ``None`` entries are skipped)."""
    stamp = next(_clock)
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            setattr(tensor, _OVERWRITTEN_AT, stamp)


def note_scaled(tensors, factor, divide: bool) -> None:
    """Each of ``tensors`` (whole shards) was multiplied (or divided) by the scalar ``factor``; logged only on
    a shard that holds a deferred gradient, so an optimizer's scalings of its states cost one attribute read."""
    for tensor in tensors:
        scales = getattr(tensor, _SCALES, None) if isinstance(tensor, torch.Tensor) else None
        if scales is not None:
            scales.append((factor.detach().clone() if isinstance(factor, torch.Tensor) else factor, divide))


def _holder(param) -> Optional[torch.Tensor]:
    grad = param.grad
    return None if grad is None else getattr(grad, "_local", grad)  # (a shard: its _local)


def remember_holder(param) -> None:
    """End of a deferring backward that reached ``param``: the shard its ``.grad`` holds now gets an empty log."""
    holder = _holder(param)
    if holder is None:
        return
    setattr(holder, _SCALES, [])
    setattr(holder, _NAME, getattr(param, "_name", None) or "a sharded parameter")
    key = id(holder)
    _LOGGING[key] = weakref.ref(holder, lambda _, key=key: _LOGGING.pop(key, None))


def as_edited(param, kept: torch.Tensor, since: int) -> Optional[torch.Tensor]:
    """``kept`` (the deferred sum of ``param``'s gradient, deferred at ``since``) after what the script did to
    ``.grad`` since: ``None`` if thrown away, else ``kept`` scaled in place.  Consumes the scale log."""
    if param is None:
        return kept
    holder = _holder(param)
    if holder is None or getattr(holder, _OVERWRITTEN_AT, 0) > since:
        return None  # zero_grad(), or zeros written over it
    scales = getattr(holder, _SCALES, None)
    if scales:
        for factor, divide in scales:
            kept.div_(factor) if divide else kept.mul_(factor)
        scales.clear()
    return kept


def forget_holder(param) -> None:
    """The deferral is used up: writes into ``.grad`` are no longer logged."""
    holder = _holder(param) if param is not None else None
    if holder is not None and hasattr(holder, _SCALES):
        delattr(holder, _SCALES)
        _LOGGING.pop(id(holder), None)


def refusal_of_use_of_pending(func, args, kwargs, whole_shard) -> Optional[str]:
    """Why ``func`` may not run (the op table raises it as ``ShardedOpError``), if it uses a ``.grad`` shard
    holding a deferral other than by a view, by zeros or a scale by one scalar over the whole shard (see the Note
    above); else ``None``.  ``whole_shard(t)``: the shard a write into ``t`` covers whole, or ``None``.  Asked for
    every op while any shard holds a deferral."""
    pending = _pending_in(args)
    if pending is None:
        pending = _pending_in(kwargs.values())
    if pending is None or func.is_view or torch._C._current_graph_task_id() != -1:
        return None
    if func in _KEPT_WRITES and _writes_whole_shards(func, args, kwargs, whole_shard):
        return None
    return _pending_refusal(str(func), pending)


def refuse_read_of_pending(grad: torch.Tensor, what: str) -> None:
    """Raise ``ShardedOpError`` if ``grad`` (a ShardedParam) is a ``.grad`` shard holding a deferral and no
    backward is running: ``to_local()``, ``full_tensor()`` and ``to_dtensor()`` hand out or gather the shard
    without the op table, and read the placeholder's zeros (a write into ``to_local()`` was lost)."""
    local = getattr(grad, "_local", None) if _LOGGING else None  # (no shard holds a deferral: one dict read)
    if local is not None and hasattr(local, _SCALES) and torch._C._current_graph_task_id() == -1:
        raise ShardedOpError(_pending_refusal(what, local))


def _pending_refusal(what: str, pending: torch.Tensor) -> str:
    name = getattr(pending, _NAME, "a sharded parameter")
    return (
        f"{what} on the .grad of {name!r} between no_sync micro-batches: until the synced backward its gradient "
        "is summed aside (the .grad shard holds zeros, not DDP's local sum of this rank), so this op would compute "
        "on zeros and differ from DDP silently. Read, clip, log or replace gradients after the last micro-batch's "
        "backward, run with sync on (outside no_sync / gradient_sync(model, False)). Between micro-batches, "
        "zero_grad() and a scale by one scalar (p.grad.mul_(s), div_) act on the sum as under DDP.")


def _pending_in(values) -> Optional[torch.Tensor]:
    for value in values:
        if isinstance(value, (list, tuple)):
            found = _pending_in(value)
            if found is not None:
                return found
        elif isinstance(value, torch.Tensor):
            local = getattr(value, "_local", None)
            if local is not None and hasattr(local, _SCALES):
                return local
    return None


def _writes_whole_shards(func, args, kwargs, whole_shard) -> bool:
    """Zeros, or a scale by one scalar, over whole shards only (every pending shard among the operands is the
    one written, and through no partial view)."""
    if kwargs or _pending_in(args[1:]) is not None:
        return False
    targets = list(args[0]) if isinstance(args[0], (list, tuple)) else [args[0]]
    if any(whole_shard(t) is None for t in targets):
        return False  # a write through a row view (grad[pad].zero_())
    if func.overloadpacket in _ZEROS:
        value = args[1] if len(args) > 1 else 0
        return _is_zero(value)
    return _is_scalar(args[1])


def _is_zero(value) -> bool:
    if isinstance(value, torch.Tensor):
        return type(value) is torch.Tensor and value.dim() == 0 and not bool(value)
    return value == 0


def _is_scalar(value) -> bool:
    if isinstance(value, torch.Tensor):
        return type(value) is torch.Tensor and value.dim() == 0
    return not isinstance(value, (list, tuple))


_aten = torch.ops.aten
_ZEROS = {_aten.zero_, _aten._foreach_zero_, _aten.fill_}
_KEPT_WRITES = {_aten.zero_.default, _aten._foreach_zero_.default, _aten.fill_.Scalar, _aten.fill_.Tensor,
                _aten.mul_.Scalar, _aten.mul_.Tensor, _aten.div_.Scalar, _aten.div_.Tensor,
                _aten._foreach_mul_.Scalar, _aten._foreach_mul_.Tensor, _aten._foreach_div_.Scalar,
                _aten._foreach_div_.Tensor}
