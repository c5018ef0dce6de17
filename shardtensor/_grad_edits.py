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

A ``copy_`` into ``.grad`` or a new tensor assigned to it is not taken for a replacement (taking it so, as a
first attempt did, threw the sum away under ``p.grad = p.grad.clone()``): such writes are mostly computed from
``.grad`` itself, that is from the placeholder's zeros, and keeping the sum gives DDP's result where they copy
or add to it (``clone()``, ``+ c``); one not linear in it (a clamp that binds, ``nan_to_num`` of a NaN) or
independent of it (``copy_(x)``) differs from DDP (README, Limits).

``None`` in ``.grad`` means ``zero_grad(set_to_none=True)`` ran (a deferring backward leaves the placeholder).
A kept-whole parameter defers nothing: its ``.grad`` sums this rank's gradients as under DDP (see [Note:
replicated gradients] in reduce.py), so every write into it is what DDP sees.  A read of ``.grad`` there (a clip's
norm) sees the placeholder's zeros, as under FSDP2.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Optional

import torch

_clock = itertools.count(1)
_OVERWRITTEN_AT = "_shardtensor_overwritten_at"
_SCALES = "_shardtensor_scales"  # on a shard holding a deferral: [(factor, divide), ...] written since
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
