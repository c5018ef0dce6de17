"""torch.compile(fullgraph=True) of a sharded model used the way a training script uses it: training steps with
evaluations between them under ``torch.no_grad()`` and ``torch.inference_mode()``.  Each grad mode is a guard of
every compiled frame, the root module's hooks included (Dynamo compiles a root's hooks as frames of their own):
the frames must stay within Dynamo's recompile limit, which ``fullgraph=True`` turns into a hard failure.  And
without ``fullgraph``, a graph break inside a block (a debug print): the code around it runs eagerly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtensor
from rank_pool import run_on_ranks
from test_compile import _assert_same, _batches, _gpt, _loss, _train


def _train_and_evaluate(model, run, batches) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    out = []
    for step in batches:
        model.train()
        _loss(run, step[dist.get_rank()]).backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.no_grad():
            out.append(_loss(run, step[0]).item())
        with torch.inference_mode():
            out.append(_loss(run, step[-1]).item())
    return out


def grad_modes_case(gather: str) -> tuple:
    import torch._dynamo

    torch._dynamo.reset()
    batches = _batches(dist.get_world_size())
    eager = shardtensor.shard_module(_gpt(True), gather=gather)
    expected = _train_and_evaluate(eager, eager, batches)
    model = shardtensor.shard_module(_gpt(True), gather=gather)
    got = _train_and_evaluate(model, torch.compile(model, backend="aot_eager", fullgraph=True), batches)
    return got, expected


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_compiled_training_with_no_grad_and_inference_mode_evaluations_equals_eager(gather):
    # Before: every root hook was called through one wrapper's __call__, so Dynamo compiled that one code object
    # for each hook and grad mode, and the third grad mode hit the recompile limit (FailOnRecompileLimitHit).
    for got, expected in run_on_ranks(2, grad_modes_case, gather):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5)


class _BreakAfter(nn.Module):
    """A block followed by a graph break (a debug print, an ``.item()`` branch), inside its gather unit."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        y = self.block(x)
        torch._dynamo.graph_break()
        return y


def graph_break_case(gather: str) -> tuple:
    import torch._dynamo

    torch._dynamo.reset()

    def build():
        model = _gpt(True)
        model.blocks[0] = _BreakAfter(model.blocks[0])
        return model

    batches = _batches(dist.get_world_size())
    plain = build()
    reference = _train(plain, plain, batches, sharded=False)
    model = shardtensor.shard_module(build(), gather=gather)
    got = _train(model, torch.compile(model, backend="aot_eager"), batches, sharded=True)
    return got, reference


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_a_graph_break_inside_a_block_trains_as_the_unsharded_model(gather):
    # Before: after the break Dynamo compiled the parameter read (the attribute through its gradient boundary) as
    # a frame of its own, whose graph returned the ShardedParam, and the backward failed in AOTAutograd
    # ("Expected a ShardedParam tangent but got a plain Tensor").
    for got, reference in run_on_ranks(2, graph_break_case, gather):
        _assert_same(got, reference, 1e-4)


def auto_mode_case() -> tuple:
    import warnings

    import torch._dynamo

    torch._dynamo.reset()
    batches = _batches(dist.get_world_size())
    plain = _gpt(True)
    reference = _train(plain, plain, batches, sharded=False)
    model = shardtensor.shard_module(_gpt(True), gather="auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _train(model, torch.compile(model, backend="aot_eager", fullgraph=True), batches, sharded=True)
    return got, reference, [str(w.message) for w in caught if "gather='auto'" in str(w.message)]


def test_auto_mode_under_compile_says_it_compiles_as_overlapped():
    # A compiled graph's gathers are fixed when it is traced: auto mode cannot switch there, and says so once.
    for got, reference, warned in run_on_ranks(2, auto_mode_case):
        _assert_same(got, reference, 1e-4)
        assert len(warned) == 1, warned
        assert "gather='sequential'" in warned[0]
