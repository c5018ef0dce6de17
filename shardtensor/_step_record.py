"""The cross-rank record of optimizer steps: each step over sharded parameters is counted per process group,
with a digest of its hyperparameters, so that a step taken on some ranks only (or with another learning rate) is
named at the next gather (see [Note: optimizer steps in the record] in ``_comm_divergence``)."""

from __future__ import annotations

import zlib
from typing import Iterable

import torch

from . import _comm

_NUMBERS = (int, float, bool)  # (bool is an int; str and None compare as they are)


def _is_setting(value) -> bool:
    """A number (or a tuple of numbers, as ``betas``): what a step's arithmetic reads.  Other values (a callback
    kept in a group) may print an address, which differs between processes."""
    if isinstance(value, (tuple, list)):
        return all(isinstance(v, _NUMBERS) for v in value)
    return isinstance(value, (*_NUMBERS, str, type(None)))


def settings_digest(optimizer: torch.optim.Optimizer, sharded_groups: list) -> int:
    """A digest of the step's hyperparameters (the lr, weight decay, betas... of each group holding sharded
    parameters; a group of a rank's own unsharded module may differ), which must agree across ranks as the step
    counts must (an LR scheduler stepped under ``if rank == 0:`` moves each rank's rows by another rate)."""
    groups = optimizer.param_groups
    return zlib.crc32(repr([[(k, v) for k, v in sorted(groups[i].items()) if k != "params" and _is_setting(v)]
                            for i in sharded_groups]).encode())


def note_optimizer_step(params: Iterable[torch.Tensor], settings: int = 0) -> None:
    """Count one optimizer step over ``params`` (``shardtensor.note_optimizer_step``).

    ``torch.optim`` optimizers are counted by the global step hook above.  An optimizer that is not a
    ``torch.optim.Optimizer`` and steps other tensors than the sharded parameters (``shardtensor.optim.Muon``
    steps each owner's local tensors) calls this after each step, on every rank, with the sharded parameters it
    updated, so that a step taken on some ranks only is named at the next gather (see [Note: optimizer steps
    in the record]).  A group none of whose parameters has a gradient is not counted: the step changed nothing
    there.  ``settings``: a number standing for the step's hyperparameters (the same on every rank unless
    something differs; 0 when the optimizer has none to compare)."""
    from .tensor import ShardedParam

    groups: dict = {}
    for p in params:
        if isinstance(p, ShardedParam) and p.grad is not None:
            groups.setdefault(id(p._layout.group), p._layout.group)
    for group in groups.values():
        _comm.count_optimizer_step(group, settings)
