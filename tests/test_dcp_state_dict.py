"""torch's own checkpoint recipe on a sharded model: ``get_state_dict`` + ``dcp.save``, then ``dcp.load`` +
``set_state_dict`` at the same or another world size, bit-exact with Adam's moments; and ``load_checkpoint``
into a fresh optimizer whose parameters already have gradients (torch's helper skips making state then)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import shardtensor
from rank_pool import run_on_ranks


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)  # 7 and 5 rows: padded shards at world 2
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Linear(5, 1))


def _train(model, opt, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt) -> dict:
    optim = {name: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in values.items()}
             for name, values in shardtensor.sharded_optimizer_state_dict(model, opt)["state"].items()}
    return {"model": shardtensor.full_state_dict(model), "optim": optim, "lr": opt.param_groups[0]["lr"]}


def torch_recipe_case(path: str, mode: str) -> dict:
    model = shardtensor.shard_module(_model(0 if mode == "save" else 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 if mode == "save" else 0.5)
    if mode == "save":
        _train(model, opt, 2, 0)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        return _snapshot(model, opt)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return _snapshot(model, opt)


def grads_present_case(path: str) -> dict:
    """A fresh optimizer, parameters with gradients (a backward ran): the load must still restore the moments,
    leave the gradients alone; and saving a fresh optimizer must leave it fresh (no state, so no extra step)."""
    model = shardtensor.shard_module(_model(1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    shardtensor.save_checkpoint(path + "-fresh", model, opt)
    fresh_after_save = not opt.state
    model(torch.ones(2, 6)).sum().backward()
    grads = [p.grad.to_local().clone() for p in model.parameters()]
    shardtensor.load_checkpoint(path, model, opt, verify_checksums=False)  # written by dcp.save: no checksum file
    kept = all(p.grad is not None and torch.equal(p.grad.to_local(), g) for p, g in zip(model.parameters(), grads))
    return {**_snapshot(model, opt), "grads_kept": kept, "fresh_after_save": fresh_after_save}


def _assert_same(loaded: dict, saved: dict) -> None:
    assert loaded["lr"] == saved["lr"] == 1e-2
    assert loaded["model"].keys() == saved["model"].keys() and loaded["optim"].keys() == saved["optim"].keys()
    for key, value in saved["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    for name, values in saved["optim"].items():
        assert loaded["optim"][name].keys() == values.keys(), name
        for k, v in values.items():
            assert torch.equal(loaded["optim"][name][k], v), (name, k)


def test_torch_get_state_dict_dcp_set_state_dict_round_trip_and_reshard(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, torch_recipe_case, path, "save")[0]
    assert saved["optim"] and all(v["step"] == 2 for v in saved["optim"].values())
    for world in (2, 1):
        for loaded in run_on_ranks(world, torch_recipe_case, path, "load"):
            _assert_same(loaded, saved)
    for result in run_on_ranks(2, grads_present_case, path):
        _assert_same(result, saved)
        assert result["grads_kept"] and result["fresh_after_save"]


def unverified_damaged_case(path: str) -> tuple:
    model = shardtensor.shard_module(_model(1))
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    before = _snapshot(model, opt)
    try:
        shardtensor.load_checkpoint(path, model, opt, verify_checksums=False)
        error = "no error"
    except Exception as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
    after = _snapshot(model, opt)
    same = all(torch.equal(before["model"][k], after["model"][k]) for k in before["model"]) and all(
        torch.equal(before["optim"][n][k], after["optim"][n][k]) for n in before["optim"] for k in before["optim"][n])
    return error, same


def test_an_unverified_load_of_a_checkpoint_missing_a_file_changes_nothing(tmp_path):
    # No checksums to compare, but DCP's metadata lists every file and where its items end: DCP itself copied
    # what it could read, then failed on the missing file (every parameter changed, the moments on one rank).
    import shutil

    path = tmp_path / "ckpt"
    run_on_ranks(2, torch_recipe_case, str(path), "save")
    for damage in ("delete", "truncate"):
        damaged = tmp_path / damage
        shutil.copytree(path, damaged)
        data = damaged / "__1_0.distcp"
        data.unlink() if damage == "delete" else data.write_bytes(data.read_bytes()[:-100])
        for error, unchanged in run_on_ranks(2, unverified_damaged_case, str(damaged)):
            assert "CheckpointError" in error and "__1_0.distcp" in error and "nothing was loaded" in error, error
            assert unchanged, damage


def full_export_case(cpu_offload: bool) -> dict:
    """FSDP2's export recipe: ``get_model_state_dict`` / ``get_optimizer_state_dict`` with
    ``full_state_dict=True``, against the unsharded model and AdamW trained on every rank's batch."""
    import copy

    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.Linear(5, 11)).double()
    model = shardtensor.shard_module(copy.deepcopy(reference))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    xs = [torch.randint(0, 11, (4,), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    model(xs[rank]).square().mean().backward()
    (sum(reference(x).square().mean() for x in xs) / world).backward()
    for opt in opts:
        opt.step()
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, opts[0], options=options)
    ref_optim = get_optimizer_state_dict(reference, opts[1], options=StateDictOptions(full_state_dict=True))
    out = {"keys": len(model_sd), "plain": all(type(v) is torch.Tensor for v in model_sd.values())}
    if model_sd:
        out["model_diff"] = max((model_sd[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        out["optim_diff"] = max((optim_sd["state"][k][m] - ref_optim["state"][k][m]).abs().max().item()
                                for k in ref_optim["state"] for m in ("exp_avg", "exp_avg_sq"))
        out["optim_plain"] = all(type(optim_sd["state"][k][m]) is torch.Tensor for k in optim_sd["state"]
                                 for m in ("exp_avg", "exp_avg_sq"))
    out["sharded_after"] = isinstance(model.state_dict()["1.weight"], shardtensor.ShardedParam)
    return out


def test_torchs_full_state_dict_export_gives_full_tensors(tmp_path):
    # get_model_state_dict(full_state_dict=True) gave each ShardedParam as this rank's rows: rank 0 saved part of
    # the model (FSDP2's export recipe), silently.
    for cpu_offload in (True, False):
        for rank, out in enumerate(run_on_ranks(2, full_export_case, cpu_offload)):
            assert out["sharded_after"], out  # a plain state_dict() keeps its shards (DCP saves rows)
            if cpu_offload and rank:
                assert out["keys"] == 0, out  # torch's helper: rank 0 only
                continue
            assert out["keys"] == 5 and out["plain"] and out["optim_plain"], out
            assert out["model_diff"] < 1e-12 and out["optim_diff"] < 1e-12, out


def cpu_adam_full_export_case() -> dict:
    """``CPUAdam`` through torch's full_state_dict helper: its moments as full plain tensors, equal to its own
    shards gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from shardtensor.optim import CPUAdam

    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3)))
    opt = CPUAdam(model.parameters(), lr=1e-2)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))["state"]
    own = opt.state_dict()["state"]
    names = [n for n, _ in model.named_parameters()]
    out = {"plain": all(type(full[n][m]) is torch.Tensor for n in names for m in ("exp_avg", "exp_avg_sq")),
           "diff": max((full[n][m] - own[i][m].full_tensor()).abs().max().item()
                       for i, n in enumerate(names) for m in ("exp_avg", "exp_avg_sq"))}
    opt.close()
    return out


def test_cpu_adams_state_through_torchs_full_state_dict_helper_is_full():
    # CPUAdam wraps its moments as shards after torch's state-dict hooks ran: they came back as this rank's rows.
    for out in run_on_ranks(2, cpu_adam_full_export_case):
        assert out["plain"] and out["diff"] == 0.0, out
