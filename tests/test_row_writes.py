"""Indexed writes into sharded tensors (``w[ids] = v``, ``w[ids, col] = 0``, masks, ``index_fill_``,
``index_copy_``, ``masked_fill_``, ``nn.init.sparse_`` through them, a gradient's rows zeroed, a ``copy_`` whose
source broadcasts) equal the same
writes on plain tensors at world 1, 2 and 4; indices that differ between ranks are refused on every rank before
anything is written.  (They were all refused with ShardedOpError, and ``sparse_`` left its draw written.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rank_pool import run_on_ranks

KINDS = ["rows_scalar", "rows_values", "rows_accumulate", "row_and_col", "bool_rows", "bool_full", "cols_values",
         "index_fill_0", "index_fill_1", "index_copy_0", "index_copy_1", "masked_fill_full", "masked_fill_rows",
         "sparse_", "grad_rows", "copy_row", "copy_1xn", "copy_column", "copy_flat_view_one"]


def write(kind: str, w: torch.Tensor, seed: int) -> None:
    """One indexed write into ``w`` (rows x cols), its indices and values drawn from ``seed``."""
    rows, cols = w.shape
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-rows, rows, (3,), generator=gen)  # negative and repeated ones too
    col_ids = torch.randint(0, cols, (2,), generator=gen)
    values = torch.randn(3, cols, generator=gen, dtype=w.dtype)
    if kind in ("rows_scalar", "grad_rows"):
        w[ids] = 0.5
    elif kind == "rows_values":
        w[ids[:1]] = values[:1]
    elif kind == "rows_accumulate":
        w.index_put_((ids,), values, accumulate=True)
    elif kind == "row_and_col":
        w[ids, int(col_ids[0])] = -1.0
    elif kind == "bool_rows":
        w[torch.rand(rows, generator=gen) < 0.5] = 2.0
    elif kind == "bool_full":
        w[torch.rand(rows, cols, generator=gen) < 0.5] = 3.0
    elif kind == "cols_values":
        w[:, col_ids[:1]] = torch.randn(rows, 1, generator=gen, dtype=w.dtype)
    elif kind.startswith("index_fill_"):
        dim = int(kind[-1])
        w.index_fill_(dim, ids if dim == 0 else col_ids, 4.0)
    elif kind.startswith("index_copy_"):
        dim = int(kind[-1])
        index = torch.randperm(w.shape[dim], generator=gen)[: min(2, w.shape[dim])]
        source = torch.randn(*([len(index), cols] if dim == 0 else [rows, len(index)]), generator=gen, dtype=w.dtype)
        w.index_copy_(dim, index, source)
    elif kind == "masked_fill_full":
        w.masked_fill_(torch.rand(rows, cols, generator=gen) < 0.3, 5.0)
    elif kind == "masked_fill_rows":
        w.masked_fill_(torch.rand(rows, 1, generator=gen) < 0.5, 6.0)
    elif kind == "copy_row":  # copy_ broadcasts its source, as torch's does (it was refused)
        w.copy_(values[0])
    elif kind == "copy_1xn":
        w.copy_(values[:1])
    elif kind == "copy_column":
        w.copy_(torch.randn(rows, 1, generator=gen, dtype=w.dtype))
    elif kind == "copy_flat_view_one":
        w.view(-1).copy_(values[0, :1])
    elif kind == "sparse_":
        torch.manual_seed(seed)
        torch.nn.init.sparse_(w, 0.4)
    else:
        raise AssertionError(kind)


def writes_case(cases: list) -> list:
    """Each ``(rows, cols, kind, seed)``: the largest difference between the sharded write and the plain one."""
    import shardtensor

    diffs = []
    for rows, cols, kind, seed in cases:
        torch.manual_seed(seed)
        plain = torch.nn.Linear(cols, rows, bias=False, dtype=torch.float64)
        sharded = shardtensor.shard_module(torch.nn.Linear(cols, rows, bias=False, dtype=torch.float64))
        sharded.load_state_dict(plain.state_dict())
        if kind == "grad_rows":  # a gradient's rows zeroed after backward (embedding rows kept fixed)
            x = torch.randn(4, cols, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
            for model in (plain, sharded):
                model(x).square().sum().backward()
            write(kind, plain.weight.grad, seed)
            write(kind, sharded.weight.grad, seed)
            diffs.append((sharded.weight.grad.full_tensor() - plain.weight.grad).abs().max().item())
            continue
        with torch.no_grad():
            write(kind, plain.weight, seed)
            write(kind, sharded.weight, seed)
        diffs.append((shardtensor.full_state_dict(sharded)["weight"] - plain.weight).abs().max().item())
    return diffs


# No shrinking: each example runs on a pool of ranks, and a failure already names its write and shape.
PROPERTY = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.mark.parametrize("world", [1, 2, 4])
@PROPERTY
@given(shapes=st.lists(st.tuples(st.integers(1, 9), st.integers(1, 5), st.integers(0, 10_000)), min_size=1,
                       max_size=3))
def test_indexed_writes_equal_the_same_writes_on_plain_tensors(world, shapes):
    cases = [(rows, cols, kind, seed + k) for k, kind in enumerate(KINDS) for rows, cols, seed in shapes[:1]]
    cases += [(rows, cols, KINDS[(seed + k) % len(KINDS)], seed) for k, (rows, cols, seed) in enumerate(shapes[1:])]
    for rank, diffs in enumerate(run_on_ranks(world, writes_case, cases, timeout=120)):
        for case, diff in zip(cases, diffs):
            assert diff == 0.0, f"rank {rank}: {case} differs by {diff:.3g}"


def per_rank_indices_case() -> dict:
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    model = shardtensor.shard_module(torch.nn.Linear(3, 6, bias=False))
    before = model.weight.to_local().clone()
    outcome = {}
    for what, fn in {"w[ids] = 0": lambda w: w.__setitem__(torch.tensor([dist.get_rank()]), 0.0),
                     "index_fill_": lambda w: w.index_fill_(0, torch.tensor([dist.get_rank() + 2]), 1.0),
                     "masked_fill_": lambda w: w.masked_fill_(torch.eye(6, 3, dtype=torch.bool).roll(dist.get_rank()),
                                                              1.0)}.items():
        try:
            with torch.no_grad():
                fn(model.weight)
            outcome[what] = "no error"
        except ValueError as exc:
            outcome[what] = str(exc)
    outcome["unchanged"] = torch.equal(before, model.weight.to_local())
    return outcome


def test_indexed_writes_with_indices_that_differ_between_ranks_are_refused_on_every_rank():
    for rank, out in enumerate(run_on_ranks(2, per_rank_indices_case, timeout=60)):
        assert out.pop("unchanged"), f"rank {rank}: the shard changed"
        for what, message in out.items():
            assert "differs between ranks" in message and "'weight" in message, (rank, what, message)


def torchs_index_errors_case() -> dict:
    """Writes torch refuses: the sharded write must raise the same error type, and change nothing."""
    import shardtensor

    torch.manual_seed(0)
    model = shardtensor.shard_module(torch.nn.Linear(4, 7, bias=False))
    before = model.weight.to_local().clone()
    writes = {"a mask of 6 rows on 7": lambda w: w.__setitem__(torch.ones(6, dtype=torch.bool), 1.0),
              "index_copy_ with a negative index": lambda w: w.index_copy_(0, torch.tensor([-1, 1]), torch.ones(2, 4))}
    out = {}
    for what, fn in writes.items():
        errors = []
        for w in (torch.zeros(7, 4), model.weight):
            try:
                with torch.no_grad():
                    fn(w)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - the test compares the types
                errors.append(type(exc).__name__)
        out[what] = errors
    out["unchanged"] = torch.equal(before, model.weight.to_local())
    return out


def test_indexed_writes_torch_refuses_are_refused_alike():
    # A mask of the wrong length and index_copy_'s negative index went through, sharded (torch raises IndexError).
    for rank, out in enumerate(run_on_ranks(2, torchs_index_errors_case, timeout=60)):
        assert out.pop("unchanged"), rank
        for what, (plain, sharded) in out.items():
            assert plain == sharded == "IndexError", (rank, what, plain, sharded)
