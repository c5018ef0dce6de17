"""An unsharded run's optimizer state loaded into a sharded model's optimizer: each rank keeps its own rows.

FSDP2's way to resume from an unsharded checkpoint, or from ``get_optimizer_state_dict(model, opt,
options=StateDictOptions(full_state_dict=True))``, loads the same full state on every rank (``opt.load_state_dict``
or torch's ``set_optimizer_state_dict``).  Each moment then has its parameter's full shape, and a step would mix
whole tensors into shards.  So every rank keeps its rows of each, as the sharded run's own state would hold them,
once the ranks have agreed on two things in one exchange of flags and one of digests: every rank holds full state
(a mix of full and per-rank states is two different saves), and the same full tensors (an unsharded state that
differs between ranks, each rank's own run's, would give each rank its rows of another run: a patchwork).
Otherwise every rank refuses, naming the state, before anything changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _comm
from ._agreement import differing


class FullState(NamedTuple):
    """One full (unsharded) state tensor of a sharded parameter: ``param``'s ``key``."""

    name: str
    param: torch.Tensor
    key: str
    value: torch.Tensor


def is_full_state(param: torch.Tensor, value, kept_local_alike: bool, loading: bool = False) -> bool:
    """Whether ``value`` is the full tensor of the sharded ``param``'s shape rather than its rows.  Where a shard
    has the full shape (one row, or one rank), a stock optimizer's own state is a sharded tensor, so a plain one is
    full; an optimizer whose own state is plain rows (``kept_local_alike``: CPUAdam's) cannot tell, and keeps it,
    except while ``loading`` under a layer-wise layout, where the owner's rows are the full tensor (either reading
    gives the same rows) and every rank must take the same values for full (their digests are compared together);
    at a step the owner's own state is that shape and is its own.  Layer-wise
    layouts were left out before: a full state failed half-way through the first step (helper I)."""
    from ._layout import ShardLayout
    from .tensor import ShardedParam

    if not isinstance(param, ShardedParam) or not isinstance(param._layout, ShardLayout):  # (OwnerLayout too)
        return False
    if isinstance(value, ShardedParam) or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    whole_on_one_rank = loading and type(param._layout) is not ShardLayout  # layer-wise: the owner holds it whole
    return value.shape == param.shape and (value.shape != param._layout.local_shape() or not kept_local_alike
                                           or whole_on_one_rank)


def shaped_for_another_parameter(param: torch.Tensor, value) -> bool:
    """Whether optimizer state ``value`` is a moment of another shape than ``param`` (whole, or this rank's rows):
    a state dict of another model or parameter order.  Refused before anything changes: the step (or CPUAdam's
    load) failed at that parameter with torch's size error, after updating the ones before it."""
    from .tensor import ShardedParam

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    shape = value._layout.shape if isinstance(value, ShardedParam) else value.shape
    rows = param._layout.local_shape() if isinstance(param, ShardedParam) else param.shape
    return len(shape) == param.dim() and shape not in (param.shape, rows)


def full_states(states: list, kept_local_alike: bool) -> list[FullState]:
    """The full state tensors among ``states`` (``(param, state dict)`` pairs being loaded), in their order."""
    return [FullState(param._name, param, key, value) for param, state in states for key, value in state.items()
            if is_full_state(param, value, kept_local_alike, loading=True)]


def agree_on_full_state(owner: str, full: list[FullState], group, others_refuse: bool = False,
                        at_load: bool = False) -> None:
    """Raise on every rank unless every rank holds full state (``full``, in the same order) with the same values,
    or none does.  ``others_refuse``: this rank refuses its state for another reason, which rides in the flags,
    so every rank raises (the caller raises its own reason where it has one).  ``at_load``: the messages say
    nothing was loaded (CPUAdam checks at ``load_state_dict``), else that nothing was updated (at the step)."""
    if not _comm.is_distributed() or _comm.world_size(group) == 1:
        return
    flags = torch.tensor([float(others_refuse), float(bool(full)), float(not full)])
    _comm.all_reduce(flags, group, op="max", label=f"{owner} after a load_state_dict: whether the loaded optimizer "
                     "state is full (every rank must load)")
    refused, some_full, some_rows = (bool(f) for f in flags.tolist())
    nothing, noun = ("Nothing was loaded on any rank.", "state") if at_load else (
        "Nothing was updated on any rank.", "optimizer state")
    if refused:
        raise RuntimeError(f"{owner}: another rank's {noun} is not its own rows (its error names the state and the "
                           f"file's rank), so no rank goes on: the ranks' rows would be steps apart. {nothing} Fix: "
                           "load each rank's own file "
                           "on that rank, the same full state dict on every rank, or "
                           "shardtensor.save_checkpoint(dir, model, opt) / load_checkpoint (any world size).")
    if not some_full:
        return
    if some_rows:
        raise RuntimeError(f"{owner}: some ranks loaded a full (unsharded) optimizer state dict and others their "
                           f"own rows of a sharded run. {nothing} Fix: load the same kind of "
                           "state dict on every rank (the same full one everywhere, or each rank's own file).")
    names = differing([(f"{s.key!r} of {s.name!r}", s.param, s.value) for s in full], owner)
    if names:
        raise RuntimeError(f"{owner}: the full (unsharded) optimizer state {names[0]}"
                           f"{f' (and {len(names) - 1} more)' if len(names) > 1 else ''} differs between ranks, so "
                           f"each rank would keep its rows of another run's state (a patchwork). {nothing} Fix: load "
                           "the same full state dict on every rank (one file, or "
                           "set_optimizer_state_dict with StateDictOptions(full_state_dict=True, "
                           "broadcast_from_rank0=True)).")


def own_rows(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's padded rows of ``full`` (``param``'s shape), a fresh plain tensor: the full one can be freed."""
    return param._layout.shard_of(full.detach())
