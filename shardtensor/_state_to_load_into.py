"""Optimizer state made for a load to fill, dropped again at the next step where no load filled it.

[Note: state made to load into]
``dcp.load`` fills the tensors of the state dict it is given, in place, and loads nothing where there is no
tensor.  An optimizer that has not stepped has no state, so torch's ``get_optimizer_state_dict`` makes it (a step
at lr 0 on zeros) for FSDP2's resume recipe (get, ``dcp.load``, set).  ``shardtensor.sharded_optimizer_state_dict``
gave a fresh optimizer's dict without state, so that saving one would not change how training goes on, and a
resume through it loaded nothing, silently (helper 18: 0 of 4 states, 0.26 off the uninterrupted run after two
steps).  It now makes the state as torch does, with each 0-d ``step`` put back to 0, so that zero moments at step
0 step exactly as no state (Adam and its kin); and if no load has written into any of it (nor replaced it, by
``load_state_dict``) by the next step, on any rank, the state is dropped there: a dict taken only to be saved
leaves training as it was.  Whether a load wrote is read off the tensors' version counters, agreed across the
group in one flag exchange (a rank that holds no rows of a parameter receives nothing for it).
"""

from __future__ import annotations

import weakref

import torch

from ._agreement import any_rank

_MADE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> (id of its state, versions, group)


def _versioned(value) -> torch.Tensor:
    return getattr(value, "_local", value)  # (a ShardedParam's rows: a DTensor view of them is what DCP writes)


def made_to_load_into(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s state was just made for a load to fill (see the Note above)."""
    group = None
    for param, state in optimizer.state.items():
        group = group or getattr(getattr(param, "_layout", None), "group", None)
        for key, value in state.items():
            if key == "step" and isinstance(value, torch.Tensor) and value.dim() == 0:
                value.zero_()
    versions = [(t, t._version) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) for t in (_versioned(v),)]
    _MADE[optimizer] = (id(optimizer.state), versions, group)


def drop_if_never_loaded(optimizer: torch.optim.Optimizer) -> None:
    """At a step: drop the state made to load into if no rank's load wrote into it."""
    made = _MADE.pop(optimizer, None) if _MADE else None
    if made is None:
        return
    state_id, versions, group = made
    untouched = id(optimizer.state) == state_id and all(t._version == v for t, v in versions)
    if not any_rank(not untouched, group, f"{type(optimizer).__name__}.step(): whether a load filled the optimizer "
                    "state made to load into"):
        optimizer.state.clear()
