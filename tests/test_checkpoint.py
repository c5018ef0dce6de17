"""Checkpoints: DCP save at world W, load at world W' (resharding) bit-exact, with Adam moments; full state
dicts on rank 0 only; DTensor round trips; mismatched checkpoints name the parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardtensor
from rank_pool import run_on_ranks


def _model(seed: int) -> nn.Module:
    # Rows 7, 5, 3 and 1: not divisible by 2 or 4, so shards are padded and some ranks hold no rows.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3),
                         nn.Linear(3, 1))


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _full_optimizer_state(model, opt) -> dict:
    """Every rank: {name: {key: full tensor}} gathered from the shards."""
    sd = shardtensor.sharded_optimizer_state_dict(model, opt)
    out = {}
    for name, values in sd["state"].items():
        out[name] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in values.items()}
    return out


def save_case(path: str, seed: int) -> dict:
    model = shardtensor.shard_module(_model(seed))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train(model, opt, 2, seed)
    shardtensor.save_checkpoint(path, model, opt)
    return {"model": shardtensor.full_state_dict(model), "optim": _full_optimizer_state(model, opt)}


def load_case(path: str, seed: int) -> dict:
    model = shardtensor.shard_module(_model(seed + 1))  # different values: the load must overwrite them
    opt = torch.optim.Adam(model.parameters(), lr=0.5)  # different lr: restored from the checkpoint
    shardtensor.load_checkpoint(path, model, opt)
    loaded = {"model": shardtensor.full_state_dict(model), "optim": _full_optimizer_state(model, opt),
              "lr": opt.param_groups[0]["lr"]}
    _train(model, opt, 1, seed + 7)  # training continues from the loaded state
    loaded["after"] = shardtensor.full_state_dict(model)
    return loaded


@pytest.mark.parametrize("save_world,load_world", [(2, 4), (4, 2), (2, 1)])
def test_dcp_checkpoint_reshards_bit_exact(tmp_path, save_world, load_world):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(save_world, save_case, path, 3)[0]
    loaded = run_on_ranks(load_world, load_case, path, 3)
    for rank_result in loaded:
        assert rank_result["lr"] == 1e-2
        for key, value in saved["model"].items():
            assert torch.equal(rank_result["model"][key], value), key
        assert saved["optim"].keys() == rank_result["optim"].keys()
        for name, values in saved["optim"].items():
            for k, v in values.items():
                assert torch.equal(rank_result["optim"][name][k], v), (name, k)
    # The same continuation from the same state gives the same parameters, whichever world loaded it.
    if load_world != save_world:
        again = run_on_ranks(save_world, load_case, path, 3)[0]
        for key, value in again["after"].items():
            torch.testing.assert_close(loaded[0]["after"][key], value, rtol=1e-6, atol=1e-7)


def mismatch_case(path: str, kind: str) -> str:
    if kind == "save":
        shardtensor.save_checkpoint(path, shardtensor.shard_module(_model(0)))
        return ""
    torch.manual_seed(0)
    if kind == "shape":
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3),
                              nn.Linear(3, 1))
    else:
        model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3),
                              nn.Linear(3, 1), nn.Linear(1, 2))
    try:
        shardtensor.load_checkpoint(path, shardtensor.shard_module(model))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_checkpoint_names_the_parameter(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, mismatch_case, path, "save")
    shape_msg = run_on_ranks(2, mismatch_case, path, "shape")[0]
    assert "'model.0.weight'" in shape_msg and "(7, 6)" in shape_msg and "(8, 6)" in shape_msg, shape_msg
    key_msg = run_on_ranks(2, mismatch_case, path, "key")[0]
    assert "'model.6.weight'" in key_msg and "not in the checkpoint" in key_msg, key_msg


def rank0_case(seed: int) -> tuple:
    model = shardtensor.shard_module(_model(seed))
    sd = shardtensor.full_state_dict(model, rank0_only=True)
    return torch.distributed.get_rank(), sd


def test_full_state_dict_rank0_only():
    reference = _model(5).state_dict()
    results = run_on_ranks(2, rank0_case, 5)
    for rank, sd in results:
        if rank == 0:
            assert sd.keys() == reference.keys()
            for key, value in reference.items():
                assert torch.equal(sd[key], value), key
        else:
            assert sd == {}


def dtensor_case(rows: int) -> tuple:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    p = shardtensor.ShardedParam.from_full(full, name="w")
    d = p.to_dtensor()
    back = shardtensor.ShardedParam.from_dtensor(d)
    mesh = d.device_mesh
    replicated = shardtensor.ShardedParam.from_dtensor(distribute_tensor(full, mesh, [Replicate()]))
    reference_dt = distribute_tensor(full, mesh, [Shard(0)])  # torch's own split of the same tensor
    try:
        shardtensor.ShardedParam.from_dtensor(distribute_tensor(full, mesh, [Shard(1)]))
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    torch_split_equal = torch.equal(reference_dt.to_local(), d.to_local())
    back_equal = torch.equal(back.full_tensor(), full) and torch.equal(back.to_local(), p.to_local())
    replicated_equal = torch.equal(replicated.to_local(), p.to_local())
    d.to_local().add_(1)  # a view of the shard: writes land in the ShardedParam
    return (torch.equal(d.full_tensor(), full + 1), back_equal, replicated_equal, torch_split_equal,
            torch.equal(p.full_tensor(), full + 1), refused)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dtensor_round_trip(world):
    for rows in (5, 1, 8):
        for result in run_on_ranks(world, dtensor_case, rows):
            dt_full, back_full, replicated_equal, torch_split_equal, view_writes, refused = result
            assert dt_full and back_full and replicated_equal and torch_split_equal and view_writes
            assert "Shard(dim=1)" in refused and "redistribute" in refused


def dtensor_param_case() -> str:
    from torch.distributed.tensor import Shard, distribute_tensor

    model = nn.Linear(4, 4)
    mesh = shardtensor.ShardedParam.from_full(torch.zeros(2, 2)).to_dtensor().device_mesh
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    try:
        shardtensor.shard_module(model)
    except NotImplementedError as exc:
        return str(exc) + f" | sharded={any(isinstance(p, shardtensor.ShardedParam) for p in model.parameters())}"
    return "no error"


def test_dtensor_parameter_is_refused_clearly():
    message = run_on_ranks(2, dtensor_param_case)[0]
    assert "'weight' is already a DTensor" in message and "sharded=False" in message, message
