"""Frozen policies for ``shard_module`` (FSDP2 passes ``MixedPrecisionPolicy``/``OffloadPolicy`` the same way).

``shard_module(model, gather=GatherPolicy(...), mixed_precision=MixedPrecisionPolicy(...))`` is the same call as
the flat keywords (``gather="overlapped", prefetch_bytes=..., param_dtype=...``), which stay as shorthands.
A policy is immutable and hashable, so one object can configure many models and be compared or logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .gather import GatherMode


@dataclass(frozen=True)
class GatherPolicy:
    """When full tensors are gathered and what stays whole (see ``shard_module`` for each field)."""

    mode: GatherMode | str = GatherMode.OVERLAPPED
    prefetch_bytes: Optional[int] = None  # None: twice the 90th percentile of gather sizes
    min_free_bytes: int = 1 << 30  # auto mode's memory threshold
    persist_numel: int = 0  # parameters with fewer elements stay replicated

    def __post_init__(self):
        try:
            object.__setattr__(self, "mode", GatherMode(self.mode))
        except ValueError:
            raise ValueError(f"GatherPolicy: mode={self.mode!r}; expected one of {[m.value for m in GatherMode]}") \
                from None


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: gathers cast the (full-precision) shard before the collective and compute runs in it;
    ``reduce_dtype``: the dtype gradients are reduced in; ``output_dtype``: the root's floating outputs are cast
    to it; ``cast_forward_inputs``: the root's floating inputs are cast to ``param_dtype``.  None: no cast.  The
    fields and defaults of FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``, which is accepted too."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


def precision_policy(policy, param_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype]):
    """``shard_module``'s precision: ``mixed_precision=`` (ours or FSDP2's), else the two flat keywords."""
    if policy is None:
        return MixedPrecisionPolicy(param_dtype, reduce_dtype)
    if param_dtype is not None or reduce_dtype is not None:
        raise ValueError("shard_module: pass either mixed_precision=MixedPrecisionPolicy(...) or "
                         "param_dtype=/reduce_dtype=, not both")
    return policy
