"""CPUAdam's per-rank state in its state dicts: shards of the parameters, so whose rows they are is kept.

CPUAdam keeps each moment (and an fp32 master) as a plain tensor of its parameter's local shard shape: this
rank's rows.  Given to ``torch.save`` per rank, or to ``torch.distributed.checkpoint`` through torch's
``get_state_dict`` helpers, a plain tensor says nothing of whose rows it holds: DCP takes it for a replicated
tensor, saves one rank's copy and loads it into every rank (every other rank then steps with rank 0's moments,
silently), and rank 0's per-rank file loads on rank 1.  So ``state_dict()`` presents them as ShardedParams of the
parameter's layout (``ShardedParam.from_local``: no copy), which DCP saves and reshards as it does the
parameter, and ``load_state_dict`` takes back this rank's rows, refusing another rank's on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardtensor._full_optim_state import agree_on_full_state, full_states, own_rows, shaped_for_another_parameter
from shardtensor._torch_state_dict import full_optimizer_state_for_torch_helpers  # noqa: F401  (CPUAdam.state_dict)

from ._slots import is_sharded


def as_shards(state: dict, param: torch.Tensor) -> dict:
    """``state`` (one parameter's) with its tensors of the local shard's shape as shards of ``param``."""
    if not is_sharded(param):
        return state
    from shardtensor.tensor import ShardedParam  # noqa: PLC0415 (see _slots.is_sharded)

    local_shape = param.to_local().shape
    return {key: ShardedParam.from_local(value, param.shard_layout, name=key)
            if type(value) is torch.Tensor and value.dim() > 0 and value.shape == local_shape else value
            for key, value in state.items()}


def snapshot(state: dict) -> dict:
    """``state`` with its tensors copied.  A speculative CPUAdam's worker steps the live moments at the next
    backward even if ``step()`` is never called again: an optimizer that loaded them (replacing it) saw them move."""
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def local_rows(optimizer_name: str, states: list) -> list:
    """The given per-parameter states (``(param, state)``) with shards replaced by this rank's rows.  A shard of
    another rank or world size is refused on every rank, before anything is loaded (one flag all-reduce, only
    where the states hold shards): rank 0's own file would load on rank 0 alone."""
    refusal: Optional[str] = None
    group, shards_given = None, False
    for param, state in states:
        for key, value in state.items():
            if refusal is None and not is_sharded(value) and shaped_for_another_parameter(param, value):
                refusal = (f"{optimizer_name}.load_state_dict: state {key!r} of "
                           f"{getattr(param, '_name', None) or tuple(param.shape)!r} has shape {tuple(value.shape)}, "
                           f"but the parameter is {tuple(param.shape)}: a state dict of another model or parameter "
                           "order. Nothing was loaded. Fix: load the state saved with this model.")
            if not is_sharded(value) or not is_sharded(param):
                continue
            shards_given, group = True, param.shard_layout.group
            saved, here = value.shard_layout, param.shard_layout
            if refusal is None and ((saved.rank, saved.world) != (here.rank, here.world) or saved.shape != here.shape):
                refusal = (f"{optimizer_name}.load_state_dict: state {key!r} holds rank {saved.rank}'s rows of a "
                           f"{tuple(saved.shape)} tensor of a {saved.world}-rank run, but its parameter is "
                           f"{tuple(here.shape)} on rank {here.rank} of {here.world}: another rank's or another "
                           "run's file. Nothing was loaded on any rank. Fix: load each rank's own file on that rank "
                           "at the same world size, or shardtensor.save_checkpoint / load_checkpoint (any world "
                           "size).")
    full = full_states(states, kept_local_alike=True)  # an unsharded run's moments: each rank keeps its rows
    if full and group is None:
        group, shards_given = full[0].param.shard_layout.group, True
    if shards_given:
        try:
            agree_on_full_state(f"{optimizer_name}.load_state_dict", full, group, others_refuse=refusal is not None,
                                at_load=True)
        except RuntimeError:
            if refusal is None:
                raise
            raise RuntimeError(refusal) from None
    if refusal is not None:
        raise RuntimeError(refusal)
    rows = {(id(s.param), s.key): own_rows(s.param, s.value) for s in full}
    return [(param, {k: rows.get((id(param), k), v.to_local() if is_sharded(v) else v) for k, v in state.items()})
            for param, state in states]
