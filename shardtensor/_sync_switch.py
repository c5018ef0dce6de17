"""The gradient-sync switch, and the names DDP and FSDP2 scripts call it by on the model itself.

A DDP script accumulates with ``with model.no_sync():``, an FSDP2 one with ``model.set_requires_gradient_sync(
False)``, and accelerate calls ``model.no_sync()`` where the model has one.  ``shard_module`` leaves the model's
class alone (FSDP2 swaps it for a subclass, which changes ``type(model).__name__``, and transformers saves that
name as the architecture), so those two names are set on the root instance instead, each the same switch as
``shardtensor.gradient_sync``: an attribute error there sent the user looking for an API that exists.
"""

from __future__ import annotations

from torch import nn


class SyncSwitch:
    """Turn ``grad_sync``'s reduction off (``False``) or on (``True``) now; as a context manager, back to what it
    was on exit."""

    def __init__(self, grad_sync, enabled: bool, caller: str = "gradient_sync"):
        if not isinstance(enabled, bool):
            raise TypeError(f"{caller}: enabled={enabled!r}; expected True or False")
        self._grad_sync = grad_sync
        self._previous = grad_sync.enabled
        grad_sync.enabled = enabled

    def __enter__(self) -> "SyncSwitch":
        return self

    def __exit__(self, *exc) -> None:
        self._grad_sync.enabled = self._previous


class _OffInside:
    """DDP's ``no_sync()``: off inside the ``with`` only (called bare, it does nothing, as DDP's does)."""

    def __init__(self, grad_sync):
        self._grad_sync, self._previous = grad_sync, None

    def __enter__(self) -> "_OffInside":
        self._previous, self._grad_sync.enabled = self._grad_sync.enabled, False
        return self

    def __exit__(self, *exc) -> None:
        self._grad_sync.enabled = self._previous


HABITS = ("no_sync", "set_requires_gradient_sync", "join", "join_hook")
_JOIN_REFUSAL = ("{what} on a model sharded by shardtensor (DDP's uneven inputs: ranks with different numbers of "
                 "batches): it cannot stand in for a rank that has stopped, because every gather and gradient "
                 "reduction needs every rank's rows. Fix: give every rank the same number of steps "
                 "(DistributedSampler(drop_last=True), or let a rank that has run out step on an empty batch: an "
                 "empty batch runs and the mean over ranks stays right).")


def attach_habits(module: nn.Module, grad_sync) -> None:
    """``module.no_sync()`` (DDP's: a context manager) and ``module.set_requires_gradient_sync(flag)`` (FSDP2's),
    where the module's class has no attribute of that name of its own."""

    def no_sync() -> _OffInside:
        return _OffInside(grad_sync)

    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        SyncSwitch(grad_sync, requires_gradient_sync, "set_requires_gradient_sync")

    def join(*args, **kwargs):
        raise NotImplementedError(_JOIN_REFUSAL.format(what="model.join()"))

    def join_hook(**kwargs):
        raise NotImplementedError(_JOIN_REFUSAL.format(what="torch.distributed.algorithms.Join([model])"))

    for name, fn in zip(HABITS, (no_sync, set_requires_gradient_sync, join, join_hook)):
        if not hasattr(type(module), name) and name not in module.__dict__:
            module.__dict__[name] = fn


def detach_habits(module: nn.Module) -> None:
    for name in HABITS:
        module.__dict__.pop(name, None)
