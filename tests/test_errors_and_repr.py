"""Bad input fails loudly; repr/str never communicate and never raise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import shardtensor
from shardtensor import ShardedOpError, ShardedParam, ShardLayout
from rank_pool import run_on_ranks


def test_repr_and_str_need_no_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    p = ShardedParam.from_full(torch.randn(5, 3), name="w")
    for text, shape in ((repr(p), "(5, 3)"), (str(p), "(5, 3)"), (f"{p}", "(5, 3)"), (repr(p.t()), "(3, 5)"),
                        (repr(p.detach()), "(5, 3)")):
        assert "ShardedParam" in text and shape in text, (text, shape)


@pytest.mark.parametrize("method", ["tolist", "numpy"])
def test_host_copies_name_full_tensor_and_to_local(method):
    p = ShardedParam.from_full(torch.randn(5, 3), name="w")
    with pytest.raises(TypeError, match=rf"'w'\.{method}\(\).*full_tensor\(\)\.{method}\(\).*to_local\(\)\.{method}"):
        getattr(p, method)()
    assert getattr(p.to_local(), method)() is not None  # the way out works


@pytest.mark.parametrize("export", ["torch.from_dlpack", "numpy.from_dlpack"])
def test_dlpack_exports_are_refused_like_host_copies(export):
    """Helper E: DLPack exports the wrapper's own storage, which holds nothing: ``torch.from_dlpack(p)`` crashed
    the process (SIGSEGV) and ``numpy.from_dlpack(p)`` read memory that is not the parameter's."""
    import numpy

    p = ShardedParam.from_full(torch.randn(5, 3), name="w")
    call = torch.from_dlpack if export == "torch.from_dlpack" else numpy.from_dlpack
    with pytest.raises(TypeError, match=r"'w'\.__dlpack__\(\).*full_tensor\(\)"):
        call(p.detach())
    assert torch.equal(torch.as_tensor(call(p.to_local())), p.to_local())  # the way out works


@pytest.mark.parametrize("call", ["torch.utils.dlpack.to_dlpack", "torch.to_dlpack"])
def test_to_dlpack_of_a_shard_is_refused_not_a_crash(call):
    """Helper I: ``to_dlpack`` is a C builtin that never asks ``__dlpack__``; its capsule of a ShardedParam had
    data pointer 0 and ``torch.from_dlpack(capsule)`` crashed the process (SIGSEGV).  Run in a child process, so a
    crash fails this test instead of the whole run."""
    import subprocess
    import sys

    code = (
        "import torch, shardtensor\n"
        "p = shardtensor.ShardedParam.from_full(torch.randn(5, 3), name='w')\n"
        "try:\n"
        f"    torch.from_dlpack({call}(p)).sum()\n"
        "    print('exported')\n"
        "except TypeError as exc:\n"
        "    print('refused:', exc)\n"
        f"print('plain:', torch.from_dlpack({call}(torch.ones(2))).sum().item())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused: to_dlpack of ShardedParam 'w'" in done.stdout and "full_tensor()" in done.stdout, done.stdout
    assert "plain: 2.0" in done.stdout, done.stdout  # any other tensor passes through torch's own function


def pickled_rows_case(path: str) -> list:
    import warnings

    shardtensor._exports._warned[0] = False  # (a pooled rank process may have pickled a shard in another test)
    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Linear(3, 6))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.save(model.state_dict(), f"{path}.{torch.distributed.get_rank()}")
        torch.save(model.state_dict(), f"{path}.{torch.distributed.get_rank()}")
    return [str(w.message) for w in caught if "pickling sharded tensor" in str(w.message)]


def test_torch_save_of_a_sharded_state_dict_warns_that_it_holds_this_ranks_rows(tmp_path):
    """Helper J: nanoGPT's ``if master_process: torch.save({'model': raw_model.state_dict()})`` wrote rank 0's
    rows alone and said nothing until a resume was refused.  Once per process, naming the routes."""
    for rank, messages in enumerate(run_on_ranks(2, pickled_rows_case, str(tmp_path / "sd.pt"))):
        assert len(messages) == 1, messages
        assert f"rank {rank}'s rows of 2" in messages[0] and "save_checkpoint" in messages[0], messages


def test_repr_survives_a_broken_layout():
    p = ShardedParam.from_full(torch.randn(4, 2))
    object.__setattr__(p, "_layout", None)  # what a half-built object in a debugger may look like
    assert "unprintable" in repr(p)


def remote_repr() -> str:
    torch.manual_seed(0)  # the same weights on every rank (shard_module compares them)
    p = shardtensor.shard_module(nn.Linear(3, 5)).weight
    return repr(p)


def test_repr_on_ranks_reports_the_local_rows():
    texts = run_on_ranks(2, remote_repr)
    assert "local_rows=3/3, rank=0/2" in texts[0]
    assert "local_rows=2/3, rank=1/2" in texts[1]


def test_inplace_op_that_cannot_run_on_shards_names_the_op():
    model = shardtensor.shard_module(nn.Linear(4, 3))
    with torch.no_grad():
        model.weight[0] = 1.0  # a row assignment lands on the row's owner (``weight[padding_idx].zero_()``)
        assert torch.equal(model.weight.full_tensor()[0], torch.ones(4))
        model.weight[:, 0] = 2.0  # a column assignment: each rank writes its rows of the column
        assert torch.equal(model.weight.full_tensor()[:, 0], torch.full((3,), 2.0))
        with pytest.raises(ShardedOpError, match=r"aten\.fill_.*weight|weight.*aten\.fill_"):
            model.weight.diagonal().fill_(1.0)  # a diagonal: not run shard-wise
        with pytest.raises(ShardedOpError, match=r"aten\.add_"):
            model.weight.add_(torch.ones(3, 4))  # full plain operand: which rank's copy would it be?
        with pytest.raises(ShardedOpError, match=r"aten\.addmm_"):
            model.weight.addmm_(torch.ones(3, 2), torch.ones(2, 4))


def test_inplace_ops_that_can_run_on_shards_update_the_shard():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    expected = model.weight.detach() * 3 + 1
    shardtensor.shard_module(model)
    with torch.no_grad():
        model.weight.mul_(3).add_(1)
    torch.testing.assert_close(model.weight.full_tensor(), expected)


def test_sharding_twice_is_a_clear_error():
    model = shardtensor.shard_module(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already sharded"):
        shardtensor.shard_module(model)


def test_a_lazy_module_is_named_before_anything_is_replaced():
    model = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"'1.weight' is uninitialized.*forward with a sample batch"):
        shardtensor.shard_module(model)
    assert not isinstance(model[0].weight, ShardedParam)  # nothing replaced: the model is usable as it was
    model(torch.randn(5, 3))  # the fix: one forward gives the lazy layer its shape
    shardtensor.shard_module(model)
    assert isinstance(model[1].weight, ShardedParam)


def _functional_sparse_embedding_case() -> str:
    torch.manual_seed(0)
    table = shardtensor.shard_module(nn.Linear(6, 13))  # its weight read as a 13 x 6 embedding table
    try:
        nn.functional.embedding(torch.tensor([[1, 4, 12]]), table.weight, sparse=True).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_sparse_embedding_gradients_are_named():
    model = nn.Sequential(nn.Embedding(13, 6, sparse=True), nn.Linear(6, 2))
    with pytest.raises(ValueError, match=r"Embedding '0' has sparse=True.*Fix: build it with sparse=False"):
        shardtensor.shard_module(model)
    assert not isinstance(model[0].weight, ShardedParam)
    for message in run_on_ranks(2, _functional_sparse_embedding_case):
        assert "'weight'" in message and "torch.sparse_coo" in message and "sparse=False" in message, message


def test_unknown_gather_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="gather="):
        shardtensor.shard_module(nn.Linear(2, 2), gather="fast")


def test_buffers_and_integer_params_stay_plain():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model.register_parameter("counter", nn.Parameter(torch.tensor([1, 2]), requires_grad=False))
    shardtensor.shard_module(model)
    assert isinstance(model[0].weight, ShardedParam)
    assert not isinstance(model[1].running_mean, ShardedParam)
    assert not isinstance(model.counter, ShardedParam)


def test_full_state_dict_round_trip_and_shape_errors():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5))
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    model = shardtensor.shard_module(plain)
    full = shardtensor.full_state_dict(model)
    assert full.keys() == expected.keys()
    for key in expected:
        assert not isinstance(full[key], ShardedParam)
        torch.testing.assert_close(full[key], expected[key])
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
    shardtensor.load_full_state_dict(model, changed)
    for key, value in shardtensor.full_state_dict(model).items():
        torch.testing.assert_close(value, changed[key])
    with pytest.raises(ValueError, match=r"'0\.weight'"):
        shardtensor.load_full_state_dict(model, {**changed, "0.weight": torch.zeros(4, 3)})


def state_dict_on_ranks(seed: int) -> list[float]:
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 1))
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    model = shardtensor.shard_module(plain)
    shardtensor.load_full_state_dict(model, {k: v * 2 for k, v in expected.items()})
    full = shardtensor.full_state_dict(model)
    return [(full[k] - 2 * expected[k]).abs().max().item() for k in expected]


def test_load_full_state_dict_keeps_each_ranks_rows():
    for diffs in run_on_ranks(4, state_dict_on_ranks, 5):
        assert max(diffs) == 0.0


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 4), world=st.integers(1, 5), rank_seed=st.integers(0, 100))
def test_layout_rows_cover_the_tensor_exactly_once(rows, cols, world, rank_seed):
    shape = torch.Size((rows, cols))
    full = torch.randn(shape)
    pieces = []
    for rank in range(world):
        layout = ShardLayout(shape, -(-rows // world), rank, world)
        local = layout.shard_of(full)
        assert local.shape[0] == layout.rows_per_rank
        assert torch.all(local[layout.valid_rows:] == 0), "padding rows are zero"
        pieces.append(local[: layout.valid_rows])
    torch.testing.assert_close(torch.cat(pieces), full)


OPS = {
    "t_mm": lambda a, other: a.t().t() @ other,
    "mul_add": lambda a, other: (a * 2 + a).sum(),
    "norm": lambda a, other: torch.linalg.vector_norm(a, 3.0),
    "max": lambda a, other: a.max(),
    "mean": lambda a, other: a.mean(),
    "view_sum_dim": lambda a, other: a.reshape(-1).sum(0),
    "softmax": lambda a, other: a.softmax(dim=-1),
    "split": lambda a, other: a.split(1, dim=1)[0] + 1,
    "sum_dim0": lambda a, other: a.sum(0),
    "cumsum": lambda a, other: a.cumsum(0),
}


def op_difference(rows: int, cols: int, seed: int, name: str) -> float:
    """Max |op(sharded) - op(plain)| (on every rank of a world, or in-process for world 1)."""
    gen = torch.Generator().manual_seed(seed)  # the same tensors on every rank
    full = torch.randn(rows, cols, dtype=torch.float64, generator=gen)
    other = torch.randn(cols, 3, dtype=torch.float64, generator=gen)
    got, want = OPS[name](ShardedParam.from_full(full), other), OPS[name](full, other)
    got = got.full_tensor() if isinstance(got, ShardedParam) else got
    assert got.shape == want.shape, (name, got.shape, want.shape)
    return (got - want).abs().max().item() if want.numel() else 0.0


@settings(max_examples=20, deadline=None, derandomize=True)
@given(rows=st.integers(1, 7), cols=st.integers(1, 5), seed=st.integers(0, 1000), name=st.sampled_from(sorted(OPS)),
       world=st.sampled_from([1, 2]))
def test_ops_on_a_sharded_tensor_equal_ops_on_the_plain_tensor(rows, cols, seed, name, world):
    """Views, pointwise, reductions and compute ops give what the plain tensor gives, at world 1 and 2 (where
    rows not divisible by 2 leave padding on the last rank)."""
    if world == 1:
        diffs = [op_difference(rows, cols, seed, name)]
    else:
        diffs = run_on_ranks(2, op_difference, rows, cols, seed, name)
    assert max(diffs) <= 1e-12, (name, diffs)


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_on_two_ranks_with_padding(name):
    """Each op once at world 2 with 5 rows (rank 1 holds two rows and one padding row)."""
    assert max(run_on_ranks(2, op_difference, 5, 3, 11, name)) <= 1e-12, name


def norm_over_two_groups() -> tuple[float, float]:
    import torch.distributed as dist

    torch.manual_seed(0)
    a, b = nn.Linear(5, 3), nn.Linear(3, 7)
    expected = torch.linalg.vector_norm(torch.cat([p.detach().reshape(-1) for p in [*a.parameters(), *b.parameters()]]))
    other_group = dist.new_group(list(range(dist.get_world_size())))  # same ranks, another communicator
    shardtensor.shard_module(a)
    shardtensor.shard_module(b, group=other_group)
    params = [*a.parameters(), *b.parameters()]
    with torch.no_grad():
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params, 2.0)))
    return total.item(), expected.item()


def test_foreach_norm_over_models_sharded_on_different_groups():
    for total, expected in run_on_ranks(2, norm_over_two_groups):
        assert abs(total - expected) < 1e-5 * expected
