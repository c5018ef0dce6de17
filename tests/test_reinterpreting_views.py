"""Writes through views that reinterpret a parameter's bytes or keep every row land in the parameter.

``p.real.add_(1)`` and ``torch.view_as_real(p)[..., 0].zero_()`` on a complex parameter, ``w.view(torch.float16)``
of a float32 weight, and ``w[:, 0].zero_()`` are views in torch: a write through them changes ``p``.  They were
computed on a gathered copy (the dtype views of another element size, the complex views) or refused (a column
write), and the copy's update was dropped without a word.  Each case here is written into a sharded parameter and
into the plain tensor alike, and the bits compared (a float32 read as float16 holds NaN patterns, which
``torch.equal`` would call different from themselves).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rank_pool import run_on_ranks

COMPLEX_WRITES = {
    "p.real.add_(1)": lambda p: p.real.add_(1.0),
    "p.imag.mul_(2)": lambda p: p.imag.mul_(2.0),
    "view_as_real(p)[..., 0].zero_()": lambda p: torch.view_as_real(p)[..., 0].zero_(),
    "view_as_real(p).add_(3)": lambda p: torch.view_as_real(p).add_(3.0),
}
REAL_WRITES = {
    "w.view(float16).add_(1)": lambda w: w.view(torch.float16).add_(1.0),
    "w.view(int8).zero_()": lambda w: w.view(torch.int8).zero_(),
    "w.view(float64).fill_(2)": lambda w: w.view(torch.float64).fill_(2.0),
    "view_as_complex(w).mul_(2)": lambda w: torch.view_as_complex(w).mul_(2.0),
    "w[:, 0].zero_()": lambda w: w[:, 0].zero_(),
    "w[:, 1:].add_(1)": lambda w: w[:, 1:].add_(1.0),
    "w.view(float16)[:, 0].fill_(1)": lambda w: w.view(torch.float16)[:, 0].fill_(1.0),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.contiguous().view(torch.uint8)


def writes_case(shapes: list, seed: int) -> dict:
    """``{(write, shape): outcome}``: "equal", or what went wrong, for each write torch itself accepts."""
    from shardtensor import ShardedParam

    outcome = {}
    for shape in shapes:
        for writes, dtype in ((COMPLEX_WRITES, torch.complex64), (REAL_WRITES, torch.float32)):
            for name, write in writes.items():
                full = torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))
                param = ShardedParam.from_full(full.clone(), name="p")
                with torch.no_grad():
                    try:
                        write(full)
                    except (RuntimeError, IndexError):
                        continue  # torch refuses it on a plain tensor of this shape too
                    write(param)
                got = param.full_tensor()
                same = got.shape == full.shape and torch.equal(_bits(got), _bits(full))
                outcome[(name, tuple(shape))] = "equal" if same else "the write was lost"
    return outcome


PROPERTY = settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    phases=[Phase.explicit, Phase.generate])
SHAPES = st.lists(st.one_of(
    st.tuples(st.integers(1, 9), st.integers(1, 6)),
    st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(2, 3)),
    st.tuples(st.integers(1, 6).map(lambda n: 2 * n * 4)),  # 1-d, a whole number of wider elements per rank
), min_size=1, max_size=3)


@pytest.mark.parametrize("world", [1, 2, 4])
@PROPERTY
@given(shapes=SHAPES, seed=st.integers(0, 1000))
def test_writes_through_reinterpreting_and_row_keeping_views_equal_torchs(world, shapes, seed):
    for rank, outcome in enumerate(run_on_ranks(world, writes_case, shapes, seed, timeout=120)):
        wrong = {k: v for k, v in outcome.items() if v != "equal"}
        assert outcome and not wrong, f"rank {rank}: {wrong}"


def reads_case() -> dict:
    from shardtensor import ShardedParam

    torch.manual_seed(0)
    full = torch.randn(6, 4, dtype=torch.complex64)
    p = ShardedParam.from_full(full.clone(), name="c")
    return {"real": torch.equal(p.real * 1, full.real), "imag": torch.equal(p.imag + 0, full.imag),
            "view_as_real": torch.equal(torch.view_as_real(p) * 1, torch.view_as_real(full)),
            "abs": torch.equal(p.abs(), full.abs()),
            "is a ShardedParam over the shard": isinstance(p.real, ShardedParam)}


def test_reinterpreting_views_read_as_torchs_and_stay_sharded():
    for out in run_on_ranks(2, reads_case):
        assert all(out.values()), out
