"""Gradients kept aside while ``gradient_sync`` is off (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``).

``GradSync`` inherits these: the side buffers live on it (``_deferred``: key -> summed full local gradient,
``_deferred_at``: key -> its last deferral's stamp), and a synced backward takes them through its hooks.  They
are a module of their own because their rules (what a ``zero_grad`` throws away, which buffer a later
micro-batch starts afresh) are their own, apart from how a gradient is reduced.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _grad_landing, _misuse


class DeferredGradients:
    """The deferral half of ``GradSync`` (which defines ``_queue_finish_once`` and the two dictionaries)."""

    _deferred: dict
    _deferred_at: dict

    # [Note: deferred gradient sync]
    # ``shardtensor.gradient_sync(module, False)`` is FSDP's ``no_sync``: while it is off, each backward adds the
    # full local gradient into a side buffer (``_deferred``, one full tensor per parameter: the memory traded
    # for communication) and hands AccumulateGrad a zero shard; the next synced backward adds the buffer to its
    # gradient and reduces once.  The mean of the summed gradients is the sum of the means, so the result equals
    # reducing every micro-batch (up to summation order).
    def _defer(self, key: str, grad: torch.Tensor, owner: tuple) -> torch.Tensor:
        """Add ``grad`` to ``key``'s buffer; ``owner``: (sharded parameter, its layout)."""
        kept = self._deferred.get(key)
        if kept is None or _grad_landing.discarded_by_zero_grad(owner[0], self.deferred_at(key)):
            self._deferred[key] = grad.clone(memory_format=torch.contiguous_format)
        else:
            kept.add_(grad)
        self._deferred_at[key] = _grad_landing.deferral_stamp()
        _misuse.note_deferred(self, key, owner)  # opt.step() refuses to run while this is deferred
        return grad

    def _with_deferred(self, key: str, grad: torch.Tensor, param: Optional[torch.Tensor] = None) -> torch.Tensor:
        kept = self._deferred.pop(key, None) if self._deferred else None
        if kept is not None and _grad_landing.discarded_by_zero_grad(param, self.deferred_at(key)):
            kept = None  # zero_grad() since: thrown away
        if self._deferred:  # parameters this backward does not reach are reduced at its end (finish_pending)
            self._queue_finish_once()
        return grad if kept is None else kept.add_(grad)

    def deferred_at(self, key: str) -> int:
        """When ``key``'s gradient was last deferred (``_grad_landing.deferral_stamp``)."""
        return self._deferred_at.get(key, 0)

    def deferred_bytes(self) -> int:
        """Bytes of full local gradients waiting for the next synced backward."""
        return sum(t.numel() * t.element_size() for t in self._deferred.values())
