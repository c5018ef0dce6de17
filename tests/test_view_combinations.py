"""Pointwise ops between two differently viewed shards of one parameter equal the plain tensor's.

``p + p.t()`` on a 2x2 parameter: each operand has the same shards but a different view chain, so the shards are
not elementwise aligned; computing on the shards as they are would give ``[[0, 2], [4, 6]]`` instead of
``[[0, 3], [3, 6]]``.  At world 1 nothing is split but the view chains still differ, so the check runs there too.
"""

from __future__ import annotations

import pytest
import torch

from rank_pool import run_on_ranks
from shardtensor import ShardedParam

CASES = {
    "p + p.t()": lambda p: p + p.t(),
    "p.t() + p": lambda p: p.t() + p,
    "p * p.t()": lambda p: p * p.t(),
    "p.t() - p.t().t()": lambda p: p.t() - p.t().t(),
    "where(p > p.t())": lambda p: torch.where(p > p.t(), p, p.t()),
    "p[:, :2] + p.t()[:, :2]": lambda p: p[:, :2] + p.t()[:, :2],
}


def combined_views(n: int) -> dict:
    """Max |sharded - plain| per case, for an n x n parameter (runs on every rank, or in-process at world 1)."""
    full = torch.arange(float(n * n), dtype=torch.float64).reshape(n, n)
    sharded = ShardedParam.from_full(full.clone(), name="square")
    out = {}
    with torch.no_grad():
        for name, fn in CASES.items():
            got, want = fn(sharded), fn(full)
            got = got.full_tensor() if isinstance(got, ShardedParam) else got
            out[name] = (got - want).abs().max().item()
    return out


def test_p_plus_p_t_is_the_symmetric_sum():
    p = ShardedParam.from_full(torch.arange(4.0).reshape(2, 2), name="w")
    out = p + p.t()
    out = out.full_tensor() if isinstance(out, ShardedParam) else out
    assert torch.equal(out, torch.tensor([[0.0, 3.0], [3.0, 6.0]]))


@pytest.mark.parametrize("world,n", [(1, 3), (2, 2), (2, 3), (4, 4)])
def test_differently_viewed_shards_combine_like_plain_tensors(world, n):
    results = [combined_views(n)] if world == 1 else run_on_ranks(world, combined_views, n)
    for rank, diffs in enumerate(results):
        assert all(d == 0.0 for d in diffs.values()), (rank, diffs)
