"""DTensors in a state dict loaded into a sharded model: this rank's rows, taken without a collective.

[Note: DTensor state dicts loaded into shards]
FSDP2's resume recipe is ``sd = get_model_state_dict(model)``, ``dcp.load(sd)``, ``set_model_state_dict(model,
sd)``, with DTensor values; a shardtensor user writes it with ``shardtensor.sharded_state_dict(model)``, whose
values are ``Shard(0)`` DTensors over the parameters' own rows.  torch's ``load_state_dict`` then runs
``param.copy_(dtensor)``, which DTensor's dispatch refuses ("got mixed torch.Tensor and DTensor") on the ranks that
hold rows and lets through on a rank that holds none: an error on some ranks only, and the next collective met
ranks that had gone on.  The load pre-hook (``_agreement.agree_on_load``) therefore puts each such DTensor back as
what it describes before torch copies anything:

  - ``Shard(0)`` on a 1-d mesh over the parameter's own group, of the parameter's shape: a ShardedParam over the
    same rows (``ShardedParam.from_dtensor``, a copy into a padded shard), which ``copy_`` writes shard-wise;
  - ``Replicate()``: its local tensor, a full tensor, checked across ranks like any other;
  - anything else (another mesh or group, another placement, a layer-wise parameter, another shape): a refusal
    that rides in the load's exchange, so every rank raises ``ValueError`` naming the key and the fix, with nothing
    copied.

The same holds for optimizer state (``set_optimizer_state_dict`` with ``sharded_optimizer_state_dict``'s DTensors,
which torch's ``Optimizer.load_state_dict`` keeps as they are): at the next step each becomes the parameter's
rows (``take_dtensor_state``), before the checks of loaded state run; the step failed with the same DTensor error.
"""

from __future__ import annotations

import sys
from typing import Any

from . import _comm
from ._layout import ShardLayout


def is_dtensor(value: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # (a DTensor exists only once its module is imported)
    return module is not None and isinstance(value, module.DTensor)


def rows_of_dtensor(param, value, key: str):
    """What a DTensor ``value`` headed for the sharded ``param`` stands for (see the Note above): a ShardedParam
    over ``param``'s layout, a full tensor (``Replicate()``), or the refusal (a string)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = value.device_mesh, tuple(value.placements)
    if mesh.ndim == 1 and placements == (Replicate(),):
        return value.to_local()
    layout = param.shard_layout
    group = getattr(layout, "group", None)
    ranks = _comm.group_ranks(mesh.get_group()) if mesh.ndim == 1 else None
    fits = (mesh.ndim == 1 and placements == (Shard(0),) and tuple(value.shape) == tuple(layout.shape)
            and type(layout) is ShardLayout and ranks == _comm.group_ranks(group))
    if not fits:
        return (f"{key!r} is a DTensor of shape {tuple(value.shape)} placed {placements} on a "
                f"{mesh.ndim}-d mesh{f' of ranks {ranks}' if ranks is not None else ''}, but the sharded "
                f"parameter is {tuple(layout.shape)}, split by rows over ranks {_comm.group_ranks(group)}"
                f"{'' if type(layout) is ShardLayout else ' (layer-wise: one rank holds it)'}. "
                "Nothing was copied on any rank. Fix: load shardtensor.sharded_state_dict(model) (or "
                "sharded_optimizer_state_dict) of a model sharded like this one (dcp.load reshards any checkpoint "
                "into it), or the full tensors (dtensor.full_tensor() on every rank).")
    cls = type(param)  # ShardedParam (not imported: the tensor module's imports reach the load hooks that call this)
    return cls.from_local(cls.from_dtensor(value, name=key)._local, layout, name=key)


def take_dtensors(params: dict, state_dict: dict, prefix: str) -> str:
    """Replace each DTensor of ``state_dict`` headed for one of ``params`` (the module's sharded parameters by
    name) by what ``copy_`` into a shard takes (see the Note above); the refusal of the first one that cannot be,
    or ``""``."""
    for name, param in params.items():
        key = prefix + name
        value = state_dict.get(key)
        if is_dtensor(value):
            rows = rows_of_dtensor(param, value, key)
            if isinstance(rows, str):
                return f"load_state_dict: {rows}"
            state_dict[key] = rows
    return ""


def take_dtensor_state(optimizer) -> str:
    """The same for an optimizer's state after ``load_state_dict`` (``set_optimizer_state_dict`` with
    ``sharded_optimizer_state_dict``'s DTensors): each becomes the parameter's rows, as the optimizer's own state
    holds them (a ShardedParam, or plain rows where the optimizer keeps those: CPUAdam); a full one is left for
    the full-state check.  The refusal of the first that cannot be, or ``""``."""
    plain_rows = getattr(optimizer, "holds_local_shard_state", False)
    for param, state in optimizer.state.items():
        if not hasattr(param, "shard_layout"):  # (a ShardedParam)
            continue
        for key, value in list(state.items()):
            if is_dtensor(value):
                rows = rows_of_dtensor(param, value, f"{param._name or 'parameter'}.{key}")
                if isinstance(rows, str):
                    return f"{type(optimizer).__name__}.step(): optimizer state {rows}"
                state[key] = getattr(rows, "_local", rows) if plain_rows else rows
    return ""
