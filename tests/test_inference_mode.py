"""``torch.inference_mode()`` with sharded parameters: views of a parameter (``F.multi_head_attention_forward``
splits ``nn.Transformer``'s packed weight for cross-attention) are normal tensors there, as torch makes views of a
normal tensor, and equal the same views of the full tensor; a model evaluates as the unsharded one does."""

from __future__ import annotations

import pytest

import torch
from torch import nn

import shardtensor
from rank_pool import run_on_ranks

VIEWS = {
    "narrow": lambda w: w.narrow(0, 1, 3), "t": lambda w: w.t(), "slice": lambda w: w[1:4],
    "select": lambda w: w[2], "split": lambda w: w.split(2)[1], "split_with_sizes": lambda w: w.split([1, 5])[1],
    "chunk": lambda w: w.chunk(3)[2], "unbind": lambda w: w.unbind(0)[3], "view": lambda w: w.view(-1),
    "detach": lambda w: w.detach(), "expand": lambda w: w.expand(2, 6, 4)[1], "diagonal": lambda w: w.diagonal(),
    "transpose_then_slice": lambda w: w.transpose(0, 1)[1:], "as_strided": lambda w: w.as_strided((2, 2), (4, 1)),
    "unfold": lambda w: w.unfold(0, 2, 2), "view_then_narrow": lambda w: w.view(3, 8).narrow(1, 2, 4),
}


def views_case(mode: str) -> dict:
    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), gather=mode)
    full = shardtensor.full_state_dict(model)["0.weight"]
    out = {}
    for name, view in VIEWS.items():
        try:
            with torch.inference_mode():
                got = view(model[0].weight) * 1  # read through the view
            out[name] = torch.equal(got, view(full) * 1)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
def test_views_of_sharded_parameters_under_inference_mode_equal_the_full_tensors_views(mode):
    """Every one raised "Cannot set version_counter for inference tensor"."""
    for out in run_on_ranks(2, views_case, mode):
        assert all(v is True for v in out.values()), out


def transformer_case(mode: str) -> float:
    torch.manual_seed(0)
    build = lambda: nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True)  # noqa: E731
    plain, model = build(), build()
    model.load_state_dict(plain.state_dict())
    shardtensor.shard_module(model, gather=mode)
    src, tgt = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    plain.eval()
    model.eval()
    with torch.inference_mode():
        got, want = model(src, tgt), plain(src, tgt)
    model.train()  # and it trains on afterwards
    model(src, tgt).square().mean().backward()
    return (got - want).abs().max().item()


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
def test_an_encoder_decoder_transformer_evaluates_under_inference_mode_like_the_unsharded_one(mode):
    for diff in run_on_ranks(2, transformer_case, mode):
        assert diff < 1e-6, diff


WRITE_VIEWS = {
    "narrow": lambda w: w.narrow(0, 1, 3), "flatten": lambda w: w.flatten(),
    "unflatten": lambda w: w.unflatten(1, (2, 2)), "movedim": lambda w: w.movedim(0, 1),
    "swapaxes": lambda w: w.swapaxes(0, 1), "view_as": lambda w: w.view_as(torch.empty(6, 4)), "T": lambda w: w.T,
    "slice": lambda w: w[1:4], "select": lambda w: w[2], "view": lambda w: w.view(-1), "detach": lambda w: w.detach(),
}


def writes_case(context: str) -> dict:
    """``view(w).add_(1)`` inside ``context``: each must land in the shards, as the same write on the full tensor."""
    out = {}
    for name, view in WRITE_VIEWS.items():
        torch.manual_seed(0)
        model = shardtensor.shard_module(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
        full = shardtensor.full_state_dict(model)["0.weight"].clone()
        try:
            with {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}[context]():
                view(model[0].weight).add_(1.0)
            view(full).add_(1.0)
            out[name] = torch.equal(shardtensor.full_state_dict(model)["0.weight"], full)
        except Exception as exc:  # noqa: BLE001 - the test reports it
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_writes_through_views_under_inference_mode_land_in_the_shards(context):
    """Under inference_mode composite views (narrow, flatten, movedim, T, view_as...) reach the op table whole;
    the fallback's gathered copy took the write and dropped it, silently."""
    for out in run_on_ranks(2, writes_case, context):
        assert all(v is True for v in out.values()), out


def shard_inside_case(build_inside: bool) -> float:
    torch.manual_seed(0)
    plain = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    with torch.inference_mode():
        model = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True).eval() if build_inside else None
    if model is None:
        model = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True).eval()
    with torch.inference_mode():
        model.load_state_dict(plain.state_dict())
        shardtensor.shard_module(model)  # an eval script: everything under inference_mode
        return (model(src, tgt) - plain(src, tgt)).abs().max().item()


@pytest.mark.parametrize("build_inside", [False, True])
def test_shard_module_inside_inference_mode_evaluates_like_the_unsharded_model(build_inside):
    """The shards were inference tensors, and the first gather failed on their version counter."""
    for diff in run_on_ranks(2, shard_inside_case, build_inside):
        assert diff < 1e-6, diff


def dtype_view_case(context: str) -> dict:
    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
    w = model[0].weight
    full = shardtensor.full_state_dict(model)["0.weight"].clone()
    with {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}[context]():
        reads = torch.equal(w.t().view(torch.int32) * 1, full.t().view(torch.int32)) and \
            torch.equal(w.view(torch.float16) * 1, full.view(torch.float16))  # another element size: computed
        w.view(torch.int32).add_(1)  # the next float up, in every element
    full.view(torch.int32).add_(1)
    return {"reads": reads, "write": torch.equal(shardtensor.full_state_dict(model)["0.weight"], full)}


@pytest.mark.parametrize("context", ["inference_mode", "no_grad"])
def test_a_write_through_a_dtype_view_lands_in_the_shards(context):
    """``w.view(torch.int32).add_(1)`` went into the fallback's gathered copy and was dropped, silently."""
    for out in run_on_ranks(2, dtype_view_case, context):
        assert out == {"reads": True, "write": True}, out
