"""Resuming from a checkpoint the way training scripts do: a fresh optimizer (often with an LR scheduler built
before the load), a checkpoint saved model-only or with another optimizer, a model sharded over a subgroup.
Each either loads exactly or raises a named error on every rank with nothing changed."""

from __future__ import annotations

import pytest
import torch

import shardtensor
from rank_pool import run_on_ranks
from test_checkpoint import _bit_equal, _model, _snapshot, _train


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)  # momentum 0: no state tensors at all
    return torch.optim.AdamW(params, lr=1e-2)


def save_for_resume(path: str, kind: str, with_optimizer: bool) -> dict:
    model = shardtensor.shard_module(_model(3))
    opt = _optimizer(kind, model.parameters())
    _train(model, opt, 2, 3)
    shardtensor.save_checkpoint(path, model, opt if with_optimizer else None)
    return _snapshot(model, opt)


def resume_case(path: str, kind: str, scheduler: bool) -> dict:
    """A fresh model and optimizer (and scheduler, built before the load as resume scripts do) load ``path``, then
    train one step; on a refused load, the step is the one a fresh run would take."""
    model = shardtensor.shard_module(_model(4))
    opt = _optimizer(kind, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5) if scheduler else None
    before = _snapshot(model, opt)
    try:
        shardtensor.load_checkpoint(path, model, opt)
        error = None
    except Exception as exc:  # noqa: BLE001 - the test reads its type and text
        error = f"{type(exc).__name__}: {exc}"
    loaded, unchanged = _snapshot(model, opt), _bit_equal(before, _snapshot(model, opt))
    _train(model, opt, 1, 9)
    if sched is not None:
        sched.step()
    return {"error": error, "unchanged": unchanged, "loaded": loaded, "after": shardtensor.full_state_dict(model),
            "initial_lr": [g.get("initial_lr") for g in opt.param_groups], "lr": [g["lr"] for g in opt.param_groups]}


def fresh_run(kind: str) -> dict:
    model = shardtensor.shard_module(_model(4))
    _train(model, _optimizer(kind, model.parameters()), 1, 9)
    return shardtensor.full_state_dict(model)


@pytest.mark.parametrize("saved,loaded,expect", [
    ("model-only", "adamw", "holds no optimizer state"),
    ("sgd", "adamw", "saved with another kind of optimizer"),
])
def test_a_refused_resume_names_the_cause_and_leaves_a_fresh_optimizer_fresh(tmp_path, saved, loaded, expect):
    # Both failed inside DCP's load ("CheckpointException ranks:dict_keys([0, 1])", the missing key cut off), and
    # the fresh optimizer kept the zero state made to load into: Adam's step 1, so a run that went on after
    # catching the error took another bias correction than a fresh run.
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, save_for_resume, path, "sgd" if saved == "sgd" else "adamw", saved != "model-only")
    fresh = run_on_ranks(2, fresh_run, loaded)[0]
    for r in run_on_ranks(2, resume_case, path, loaded, False):
        assert r["error"] is not None and r["error"].startswith("CheckpointError") and expect in r["error"], r["error"]
        assert "nothing was loaded" in r["error"] and "Fix:" in r["error"], r["error"]
        assert r["unchanged"]
        assert all(torch.equal(r["after"][k], v) for k, v in fresh.items())


def test_a_scheduler_built_before_the_load_resumes_exactly(tmp_path):
    # The scheduler adds 'initial_lr' to each param group, which the checkpoint (saved without one) lacks: DCP
    # failed the whole load on that missing key.  Now the saved state loads and the group keeps its initial_lr.
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, save_for_resume, path, "adamw", True)[0]
    plain = run_on_ranks(2, resume_case, path, "adamw", False)
    for r, p in zip(run_on_ranks(2, resume_case, path, "adamw", True), plain):
        assert r["error"] is None and p["error"] is None, (r["error"], p["error"])
        assert _bit_equal(r["loaded"], saved) and _bit_equal(p["loaded"], saved)
        assert r["initial_lr"] == [1e-2] and p["initial_lr"] == [None]
        assert all(torch.equal(r["after"][k], v) for k, v in p["after"].items())  # the step ran at the saved lr
        assert r["lr"] == [5e-3]  # and the scheduler goes on from the initial_lr it keeps


def subgroup_case(root: str) -> dict:
    """World 4, a model per half (``group=``), each half saving and loading its own directory while the other
    half does the same: DCP ran over the whole world, so the halves' plans were merged (overlapping chunks)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    half = rank // 2
    torch.manual_seed(10 + half)  # the halves hold different models
    model = shardtensor.shard_module(_model(10 + half), group=halves[half])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 1, 5 + half)
    saved = _snapshot(model, opt)
    path = f"{root}/half{half}"
    shardtensor.save_checkpoint(path, model, opt)
    other = shardtensor.shard_module(_model(20), group=halves[half])
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5)
    shardtensor.load_checkpoint(path, other, other_opt)
    return {"saved": saved, "loaded": _snapshot(other, other_opt)}


def test_models_sharded_over_subgroups_save_and_load_their_own_checkpoints(tmp_path):
    results = run_on_ranks(4, subgroup_case, str(tmp_path))
    for r in results:
        assert _bit_equal(r["saved"], r["loaded"])
    assert not torch.equal(results[0]["saved"]["model"]["0.weight"], results[2]["saved"]["model"]["0.weight"])
