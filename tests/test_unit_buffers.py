"""A unit's flat gradient buffer holds exactly the bits the old pad/cast/cat reduction input held.

``FlatGrads`` writes each gradient into its slot of the reduce-scatter buffer; the reduction must send the same
bytes as before (rows that do not divide by the world padded with zeros, a second gradient added in place, zeros
and a 0 flag for a parameter this rank has no gradient for), whatever the buffer's memory held before."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

from shardtensor._layout import ShardLayout
from shardtensor._unit_buffers import FlatGrads, flat_dtype
from shardtensor.reduce import ExactReducer

WORLD = 3
SHAPES = [(5, 2), (7,), (3, 4), (1, 3)]  # 5, 7 rows: padded; 3 rows: even; 1 row: ranks 1-2 hold only padding


def _params(dtype=torch.float32):
    return [SimpleNamespace(dtype=dtype, _layout=ShardLayout(torch.Size(s), -(-s[0] // WORLD), 0, WORLD, None))
            for s in SHAPES]


def _old_buffer(params, grads: dict[int, torch.Tensor]) -> torch.Tensor:
    """The reduction input as the unit built it before: pad, cast, reshape, cat, flag columns."""
    fulls = [grads.get(i, torch.zeros(p._layout.shape, dtype=p.dtype)) for i, p in enumerate(params)]
    mine = torch.tensor([1.0 if i in grads else 0.0 for i in range(len(params))], dtype=torch.float64)
    dtype = functools.reduce(torch.promote_types, [g.dtype for g in fulls])
    pieces = [p._layout.pad(g).to(dtype).reshape(WORLD, -1) for p, g in zip(params, fulls)]
    return torch.cat([*pieces, mine.to(dtype).expand(WORLD, -1)], dim=1)


def test_flat_buffer_is_bit_identical_to_the_padded_concatenation():
    torch.manual_seed(0)
    params = _params()
    flat = FlatGrads(params, torch.float32, torch.device("cpu"))
    flat.buffer.fill_(float("nan"))  # recycled memory: every byte sent must be written
    first = torch.randn(5, 2)
    second = torch.randn(2, 5).t()  # a non-contiguous second gradient of the same parameter
    odd, last = torch.randn(7), torch.randn(1, 3)
    for position, grad in [(0, first), (1, odd), (0, second), (3, last)]:  # parameter 2: no gradient here
        flat.add(position, grad)
    kept = {0: first.clone().add_(second), 1: odd, 3: last}
    mine = torch.tensor([1.0 if had else 0.0 for had in flat.have], dtype=torch.float64)
    assert torch.equal(flat.finish(mine), _old_buffer(params, kept))
    # Leaving the flat path mid-backward hands back the same kept gradients.
    assert sorted(flat.kept()) == [0, 1, 3]
    assert all(torch.equal(flat.kept()[i], kept[i]) for i in kept)


def test_flat_path_only_where_the_old_one_neither_casts_nor_promotes():
    assert flat_dtype(_params(), ExactReducer()) == torch.float32
    assert flat_dtype(_params(torch.bfloat16), ExactReducer(torch.bfloat16)) == torch.bfloat16
    assert flat_dtype(_params(torch.bfloat16), ExactReducer(torch.float32)) is None  # reduced in fp32
    mixed = _params()
    mixed[1] = SimpleNamespace(dtype=torch.float64, _layout=mixed[1]._layout)
    assert flat_dtype(mixed, ExactReducer()) is None  # would promote
    assert flat_dtype(_params(), object()) is None  # another reducer
