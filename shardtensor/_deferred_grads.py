"""Gradients kept aside while ``gradient_sync`` is off (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``).

``GradSync`` inherits these: the side buffers live on it (``_deferred``: key -> summed full local gradient,
``_deferred_at``: key -> its last deferral's stamp, ``_deferred_now``: keys deferred since the last end of a
deferring backward), and a synced backward takes them through its hooks.  They are a module of their own
because their rules (what a script's writes into ``.grad`` do to them, which buffer a later micro-batch starts
afresh) are their own, apart from how a gradient is reduced.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _compile, _grad_edits, _misuse


class DeferredGradients:
    """The deferral half of ``GradSync`` (which defines ``_queue_finish_once`` and the three dictionaries)."""

    _deferred: dict
    _deferred_at: dict
    _deferred_now: set
    _deferred_task: dict

    # [Note: deferred gradient sync]
    # ``shardtensor.gradient_sync(module, False)`` is FSDP's ``no_sync``: while it is off, each backward adds the
    # full local gradient into a side buffer (``_deferred``, one full tensor per parameter: the memory traded
    # for communication) and hands AccumulateGrad a zero shard; the next synced backward adds the buffer to its
    # gradient and reduces once.  The mean of the summed gradients is the sum of the means, so the result equals
    # reducing every micro-batch (up to summation order).  What a script writes into ``.grad`` in between is
    # applied to the buffer (see [Note: edits of a gradient between no_sync micro-batches] in _grad_edits.py).
    def _defer(self, key: str, grad: torch.Tensor, owner: tuple) -> torch.Tensor:
        """Add ``grad`` to ``key``'s buffer; ``owner``: (sharded parameter, its layout)."""
        kept = self._deferred.get(key)
        task = torch._C._current_graph_task_id()
        # A second part of one backward's gradient (a compiled backward reduces a parameter read twice by two
        # nodes) adds to the first: .grad is not stored yet, and an edit between them cannot be.
        if kept is not None and not (task != -1 and self._deferred_task.get(key) == task):
            kept = _grad_edits.as_edited(owner[0], kept, self.deferred_at(key))
        self._deferred_task[key] = task
        if kept is None:
            self._deferred[key] = grad.clone(memory_format=torch.contiguous_format)
        else:
            kept.add_(grad)
        self._deferred_at[key] = _grad_edits.deferral_stamp()
        _misuse.note_deferred(self, key, owner)  # opt.step() refuses to run while this is deferred
        self._deferred_now.add(key)  # its .grad shard gets a fresh scale log at the end of this backward
        if task != -1 and self._holders_queued_for != task:
            self._holders_queued_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self._remember_holders)
        return grad

    def _remember_holders(self) -> None:
        """End of a deferring backward: the ``.grad`` shards of the keys it deferred (AccumulateGrad is done) get a
        fresh scale log; a key it did not reach (an expert skipped, a reentrant checkpoint's inner backward) keeps
        the log of scales written since its own (helper F: they were reset, and the scale lost)."""
        owners = self.__dict__.get("_deferred_owner", {})
        now, self._deferred_now = self._deferred_now, set()
        for key in now:
            if key in owners and key in self._deferred:
                _grad_edits.remember_holder(owners[key][0])

    def _with_deferred(self, key: str, grad: torch.Tensor, param: Optional[torch.Tensor] = None) -> torch.Tensor:
        kept = self._deferred.pop(key, None) if self._deferred else None
        if kept is not None:
            kept = self.take_deferred(key, kept, param)
        if self._deferred:  # parameters this backward does not reach are reduced at its end (finish_pending)
            self._queue_finish_once()
        return grad if kept is None else kept.add_(grad)

    def take_deferred(self, key: str, kept: torch.Tensor, param) -> Optional[torch.Tensor]:
        """``key``'s deferred sum, popped from ``_deferred``, as the script's writes into ``.grad`` left it
        (``None``: thrown away); its deferral is over."""
        kept = _grad_edits.as_edited(param, kept, self.deferred_at(key))
        _grad_edits.forget_holder(param)
        return kept

    def pop_deferred(self, param) -> Optional[torch.Tensor]:
        """``param``'s deferred sum if this synced backward has not taken it (it did not reach the parameter on
        this rank), popped as ``take_deferred`` gives it; None if there is none."""
        owners = self.__dict__.get("_deferred_owner", {})
        key = param._name  # (its gradient hook's key: ``attach(..., key=fqn)``)
        if key not in self._deferred or key not in owners or owners[key][0] is not param:
            return None
        owners.pop(key)
        return self.take_deferred(key, self._deferred.pop(key), param)

    def deferred_at(self, key: str) -> int:
        """When ``key``'s gradient was last deferred (``_grad_edits.deferral_stamp``)."""
        return self._deferred_at.get(key, 0)

    def deferred_bytes(self) -> int:
        """Bytes of full local gradients waiting for the next synced backward."""
        return sum(t.numel() * t.element_size() for t in self._deferred.values())


_compile.skip_in_dynamo(DeferredGradients._remember_holders)  # see [Note: backward hooks run eagerly] in _compile.py
