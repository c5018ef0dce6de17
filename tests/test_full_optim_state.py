"""An unsharded run's optimizer state, loaded the same on every rank (FSDP2's way to resume from a full
checkpoint): each rank keeps its rows and training goes on as the unsharded run would; a full state that differs
between ranks, or full state on some ranks and rows on others, is refused on every rank before anything changes."""

from __future__ import annotations

import pytest

import torch
from torch import nn

import shardtensor
from rank_pool import run_on_ranks


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 1))  # a one-row weight


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * step + rank))


def _optimizer(kind: str, params):
    if kind == "cpu_adam":
        from shardtensor.optim import CPUAdam

        return CPUAdam(params, lr=0.05, weight_decay=0.01)  # speculative, its default
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def resume_from_full_state_case(kind: str, how: str, placement: str = "dim0") -> float:
    """The unsharded run (every rank's batch, as DDP averages) takes 2 steps and saves its full state; the sharded
    model loads it, takes 2 more; the worst difference from the unsharded run's 4 steps."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def global_batch(step):
        return torch.cat([_batch(r, step) for r in range(world)])

    plain = _build()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    for step in range(4):
        plain(global_batch(step)).square().mean().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        if step == 1:
            model_full = {k: v.clone() for k, v in plain.state_dict().items()}
            opt_full = {"state": {i: {k: v.clone() for k, v in s.items()} for i, s in plain_opt.state_dict()["state"].items()},
                        "param_groups": plain_opt.state_dict()["param_groups"]}
    model = shardtensor.shard_module(_build(), placement=placement)
    opt = _optimizer(kind, model.parameters())
    model.load_state_dict(model_full)
    if how == "load_state_dict":
        opt.load_state_dict(opt_full)
    else:  # torch's helper, as FSDP2's docs show it, keyed by names
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in _build().named_parameters()]
        by_name = {"state": {names[i]: s for i, s in opt_full["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in opt_full["param_groups"]]}
        set_optimizer_state_dict(model, opt, by_name, options=StateDictOptions(full_state_dict=True))
    for step in (2, 3):
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind,how", [("adamw", "load_state_dict"), ("adamw", "set_optimizer_state_dict"),
                                      ("cpu_adam", "load_state_dict")])
def test_an_unsharded_runs_optimizer_state_resumes_like_the_unsharded_run(world, kind, how):
    """It was refused at the first step as "another rank's or another run's file" (and CPUAdam failed inside its
    load with torch's copy error).  At world 1 the stock optimizers' full state was taken for the shard's own
    and the first step failed half-way (helper D: AdamW had decayed and counted one parameter)."""
    for worst in run_on_ranks(world, resume_from_full_state_case, kind, how):
        assert worst < 1e-5, worst


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind,how", [("adamw", "load_state_dict"), ("adamw", "set_optimizer_state_dict"),
                                      ("cpu_adam", "load_state_dict")])
def test_a_full_optimizer_state_resumes_a_layerwise_model_like_the_unsharded_run(world, kind, how):
    """Helper I: under ``placement="layerwise"`` a full state was not taken for one, so torch's optimizers failed
    half-way through the first step (ShardedOpError at addcdiv_, after updating the first parameter's moments) and
    CPUAdam inside its load, after resetting its store."""
    for worst in run_on_ranks(world, resume_from_full_state_case, kind, how, "layerwise"):
        assert worst < 1e-5, worst


def mismatched_full_state_case(kind: str, mix: bool) -> dict:
    """Each rank loads its own unsharded run's state (``mix``: rank 0 a full state, the others their own rows)."""
    rank = torch.distributed.get_rank()
    model = shardtensor.shard_module(_build())
    opt = _optimizer(kind, model.parameters())
    model(_batch(rank, 0)).square().mean().backward()
    opt.step()
    own_rows = opt.state_dict()
    plain = _build()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    plain(_batch(rank, 0)).square().mean().backward()  # this rank's batch only: the ranks' states differ
    plain_opt.step()
    before = [p.to_local().clone() for p in model.parameters()]

    def load_and_step():
        opt.load_state_dict(own_rows if mix and rank > 0 else plain_opt.state_dict())
        model(_batch(rank, 1)).square().mean().backward()
        opt.step()

    try:
        load_and_step()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message, "unchanged": all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))}


@pytest.mark.parametrize("kind", ["adamw", "cpu_adam"])
@pytest.mark.parametrize("mix", [False, True])
def test_full_state_that_differs_between_ranks_or_beside_rows_is_refused_on_every_rank(kind, mix):
    want = "some ranks loaded a full (unsharded) optimizer state dict" if mix else "differs between ranks"
    for out in run_on_ranks(2, mismatched_full_state_case, kind, mix):
        assert want in out["message"] and "Fix:" in out["message"], out
        assert out["unchanged"], out


def another_models_state_case(how: str) -> dict:
    """An unsharded run's full state in which one moment has another shape (a state dict of another model)."""
    rank = torch.distributed.get_rank()
    plain = _build()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.01)
    plain(_batch(0, 0)).square().mean().backward()
    plain_opt.step()
    state = plain_opt.state_dict()
    state["state"][2]["exp_avg"] = torch.zeros(9, 9)  # the second weight is (3, 6)
    model = shardtensor.shard_module(_build())
    opt = _optimizer("cpu_adam" if how == "cpu_adam" else "adamw", model.parameters())
    before = [p.to_local().clone() for p in model.parameters()]
    if how == "cpu_adam":  # refused at the load (it copied the moments before it, then failed naming no key)
        try:
            opt.load_state_dict(state)
        except RuntimeError as exc:
            return {"message": str(exc), "unchanged": not opt.state}
        return {"message": "no error", "unchanged": False}
    if how == "load_state_dict":
        opt.load_state_dict(state)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in _build().named_parameters()]
        by_name = {"state": {names[i]: s for i, s in state["state"].items()},
                   "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(model, opt, by_name, options=StateDictOptions(full_state_dict=True))
    model(_batch(rank, 1)).square().mean().backward()
    try:
        opt.step()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message, "unchanged": all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))}


@pytest.mark.parametrize("how", ["load_state_dict", "set_optimizer_state_dict", "cpu_adam"])
def test_a_moment_of_another_shape_is_refused_before_anything_is_updated(how):
    """Helper D: a (9, 9) ``exp_avg`` for a (5, 7) weight loaded without a word, and the step failed with
    torch's size error after updating the parameters before it."""
    for out in run_on_ranks(2, another_models_state_case, how):
        assert "'exp_avg' of '2.weight' has shape (9, 9)" in out["message"], out
        assert ("Nothing was loaded" if how == "cpu_adam" else "Nothing was updated") in out["message"], out
        assert out["unchanged"], out
