"""Class 5 of the op table: an op that would write into a ShardedParam but cannot run on its shard raises.

Running it on a gathered temporary would compute the right value and then drop it: the silent failure this
library exists to avoid.  Every rule that meets a write it cannot do shard-wise calls ``_refuse``.
"""

from __future__ import annotations

import torch
from typing import NoReturn

from ._common import ShardedOpError, _leaves, _written_params


def _describe(func, args, kwargs) -> str:
    kinds = [type(x).__name__ + (f"{tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
             for x in _leaves(args, kwargs) if isinstance(x, torch.Tensor)]
    return f"{func} with tensor arguments {kinds}"


def _refuse(func, args, kwargs, why: str) -> NoReturn:
    names = ", ".join(repr(p._name or tuple(p.shape)) for p in _written_params(func, args, kwargs))
    raise ShardedOpError(
        f"{func} would write into ShardedParam {names} but {why}. Running it on a gathered temporary would drop "
        f"the update silently. Fix: use the out-of-place form on the full tensor, update each rank's shard "
        f"through `.to_local()`, or `shardtensor.unshard_module(model)` first. ({_describe(func, args, kwargs)})"
    )
