"""Parametrizations (``weight_norm``, ``spectral_norm``, ``orthogonal``, a user's own): applied before
``shard_module`` they train as the unsharded model does; applied after, they are named on every rank with the
fix, wherever they fail first (``orthogonal``'s ``right_inverse`` writes inside ``register_parametrization``;
the others move the parameter, named at the next forward)."""

from __future__ import annotations

import pytest

import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import shardtensor
from rank_pool import run_on_ranks


class Scaled(nn.Module):
    def forward(self, w):
        return 2.0 * w


def _apply(kind: str, layer: nn.Module) -> None:
    if kind == "weight_norm":
        parametrizations.weight_norm(layer)
    elif kind == "spectral_norm":
        parametrizations.spectral_norm(layer)
    elif kind == "orthogonal":
        parametrizations.orthogonal(layer)
    else:
        parametrize.register_parametrization(layer, "weight", Scaled())


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    _apply(kind, model[2])
    return model


def before_case(kind: str, mode: str) -> float:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    xs = [torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * s + r))
          for s in range(3) for r in range(world)]
    plain, model = _build(kind), shardtensor.shard_module(_build(kind), gather=mode)
    for m, batch in ((plain, lambda s: torch.cat(xs[s * world:(s + 1) * world])), (model, lambda s: xs[s * world + rank])):
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        m.train()
        for s in range(3):
            m(batch(s)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())


@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "custom"])
def test_parametrizations_applied_before_shard_module_train_like_the_unsharded_model(kind):
    for diff in run_on_ranks(2, before_case, kind, "overlapped"):
        assert diff < 1e-10, diff


def after_case(kind: str) -> dict:
    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6)))
    try:
        _apply(kind, model[2])
        model(torch.randn(3, 4)).sum().backward()
        message = "no error"
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        message = f"{type(exc).__name__}: {exc}"
    return {"message": message}


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal", "custom"])
def test_parametrizations_applied_after_shard_module_are_named_with_the_fix(kind):
    """``orthogonal`` was refused as an op on operands "not shards of one layout", with fixes that do not apply."""
    for out in run_on_ranks(2, after_case, kind):
        assert "'2.weight'" in out["message"] and "Fix: apply parametrizations before shard_module" in out["message"], out
