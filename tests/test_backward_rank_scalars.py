"""A backward formula that multiplies the parameter by a per-rank 0-d gradient still averages across ranks.

``linalg.vector_norm``'s backward is ``w * (grad / norm)``: the 0-d factor is this rank's upstream gradient, which
differs between ranks.  Run shard-wise, each rank's rows would be scaled by its own factor and never averaged
(a silent error of 0.23 at world 2 before the fix); the whole-gradient path reduces it like any other.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rank_pool import run_on_ranks


def norm_gradient_error(fn_name: str) -> float:
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    layer = nn.Linear(4, 5, dtype=torch.float64)  # 5 rows: the last rank's shard is padded
    full = layer.weight.detach().clone()
    shardtensor.shard_module(layer)
    world, rank = dist.get_world_size(), dist.get_rank()
    tau = torch.full((3,), 0.5, dtype=torch.float64)
    other = torch.randn(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    fns = {"vector_norm": lambda w: torch.linalg.vector_norm(w),
           "normalize_sum": lambda w: (torch.nn.functional.normalize(w, dim=0) * torch.arange(4.0, dtype=w.dtype)).sum(),
           # backward formulas that fill zeros_like(self) with the upstream gradient (helper H)
           "take": lambda w: (torch.take(w, torch.tensor([0, 7, 19])) * torch.tensor([1.0, -2.0, 3.0])).sum(),
           "householder_product": lambda w: torch.linalg.householder_product(w, tau).sum(),
           "ormqr": lambda w: torch.ormqr(w, torch.full((4,), 0.5, dtype=w.dtype), other).square().sum(),
           "take_of_a_view": lambda w: (torch.take(w.t(), torch.tensor([1, 18])) * 2.0).sum()}
    (fns[fn_name](layer.weight) * (rank + 1.0)).backward()
    reference = full.clone().requires_grad_(True)
    mean_scale = sum(r + 1.0 for r in range(world)) / world
    (fns[fn_name](reference) * mean_scale).backward()
    return float((layer.weight.grad.full_tensor() - reference.grad).abs().max())


@pytest.mark.parametrize("fn_name", ["vector_norm", "normalize_sum", "take", "householder_product", "ormqr",
                                     "take_of_a_view"])
def test_per_rank_upstream_gradient_is_averaged(fn_name):
    """``take``, ``householder_product`` and ``ormqr`` (helper H): their backward fills ``zeros_like(self)``,
    which was a shard keeping this rank's rows of this rank's gradient, taken for the mean (rows 1x and 2x the
    gradient where DDP gives 1.5x)."""
    for error in run_on_ranks(2, norm_gradient_error, fn_name):
        assert error < 1e-12, error
