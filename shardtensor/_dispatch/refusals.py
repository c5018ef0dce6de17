"""Class 5 of the op table: an op that would write into a ShardedParam but cannot run on its shard raises.

Running it on a gathered temporary would compute the right value and then drop it: the silent failure this
library exists to avoid.  Every rule that meets a write it cannot do shard-wise calls ``_refuse``.
"""

from __future__ import annotations

from typing import NoReturn

import torch

from .._frames import inside
from ..tensor import ShardedParam
from ._common import OpFamily, ShardedOpError, _leaves, _params_in, _written_params, aten, implements


def _describe(func, args, kwargs) -> str:
    kinds = [type(x).__name__ + (f"{tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
             for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor)]
    return f"{func} with tensor arguments {kinds}"


def _refuse(func, args, kwargs, why: str) -> NoReturn:
    written = _written_params(func, args, kwargs)
    names = ", ".join(repr(p._name or tuple(p.shape)) for p in written)
    if inside("register_parametrization", "parametrize.py"):  # orthogonal(layer) after shard_module
        raise ShardedOpError(
            f"a parametrization registered after shard_module (torch.nn.utils.parametrize.register_parametrization, "
            f"parametrizations.orthogonal / weight_norm / spectral_norm) runs on the sharded parameter {names}: "
            f"{func} would write into it but {why}. The tensors a parametrization puts in its place would not be "
            "sharded, nor their gradients averaged. Fix: apply parametrizations before shard_module.")
    unreduced = [p for p in written if p.is_leaf and type(p.grad) is torch.Tensor]  # (a view's .grad warns)
    raise ShardedOpError(
        f"{func} would write into ShardedParam {names} but {why}. Running it on a gathered temporary would drop "
        f"the update silently. Fix: write the out-of-place result back whole, e.g. `p.copy_(p * mask)` or "
        f"`p.copy_(p / p.norm(dim=1, keepdim=True).clamp(min=c) * c)` (a gather; each rank keeps its rows, and the "
        f"ranks' results are checked to agree), update each rank's shard through `.to_local()`, or "
        f"`shardtensor.unshard_module(model)` first. ({_describe(func, args, kwargs)})"
        + (f" Here {unreduced[0]._name!r}.grad is a full plain tensor: this rank's own gradient, never averaged, "
           "because the parameter's gradient hook is gone (the model was converted, e.g. model.float() or .to(), "
           "after shard_module, and its forward was not called to report it). Fix: convert the model before "
           "shard_module." if unreduced else "")
    )


@implements(aten.embedding_renorm_.default)
def _embedding_renorm(func, args, kwargs):
    """``F.embedding(..., max_norm=...)`` rescales, in place, the weight rows its indices pick.  Each rank picks
    by its own batch, so a sharded weight would take a different update on each rank (unsharded DDP replicas
    diverge the same way): refused with the fix, rather than writing rows back."""
    weight = args[0]
    name = (weight._name or tuple(weight.shape)) if isinstance(weight, ShardedParam) else "weight"
    raise ShardedOpError(
        f"F.embedding(..., max_norm=...) renormalises rows of the sharded weight {name!r} in place, chosen by each "
        "rank's own indices; the shards would disagree. Fix: drop max_norm (renormalise the weight yourself "
        "from indices every rank shares), or keep this embedding unsharded.")


USER_COLLECTIVES = OpFamily("torch.distributed collectives", lambda func: func.namespace == "c10d")


@implements(USER_COLLECTIVES)
def _user_collective(func, args, kwargs):
    """A ShardedParam (or its sharded gradient) handed to ``dist.all_reduce``, ``dist.broadcast``, ``dist.send``...
    The c10d schemas mark no argument as written, so the generic rule would run the collective on a gathered copy
    and drop it: a DDP-era ``dist.all_reduce(p.grad); p.grad /= world`` would divide the gradient shard_module
    already averaged, silently.  The collective is refused on every rank that calls it (DTensor refuses too)."""
    names = ", ".join(repr(p._name or tuple(p.shape)) for p in _params_in(args, kwargs))
    raise ShardedOpError(
        f"{func} (a torch.distributed collective) got the sharded parameter or gradient {names}, which holds only "
        "this rank's rows. shard_module already does what such collectives do in a DDP script: every rank starts "
        "from rank 0's weights, and backward averages each gradient across ranks. Fix: delete the manual "
        "all_reduce of gradients (and the division by the world size) or the broadcast of parameters; use a "
        "torch.optim optimizer, not ZeroRedundancyOptimizer (its state is sharded already); to send a full "
        "copy, pass p.full_tensor() (gathered on every rank) or p.to_local() (this rank's rows). A model sharded "
        "over a subgroup is averaged within that group only: to average across its replicas (HSDP), all-reduce "
        "p.grad.to_local() over the replica group and divide by its size, where every member of that group holds "
        "the same rows (shard groups of one size, their ranks in the same order).")
