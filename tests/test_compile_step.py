"""torch.compile of a sharded model's optimizer step, and of a function holding the backward and the step.

``torch.compile(opt.step)`` runs the update on each rank's rows inside the graphs torch compiles for an unsharded
step (see [Note: a compiled optimizer step] in ``shardtensor/_dispatch/traced.py``); a ``loss.backward()`` inside a
compiled function breaks the graph and runs our hooks eagerly (see [Note: backward hooks run eagerly] in
``shardtensor/_compile.py``).  Same models, batches and references as ``test_compile.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtensor
from rank_pool import run_on_ranks
from shardtensor._dispatch import traced
from test_compile import OPTIMIZERS, STEPS, _assert_same, _batches, _gpt, _loss, _train


def compiled_optimizer_step_case(world: int, optimizer: str, backend: str) -> tuple:
    """(sharded with ``torch.compile(opt.step)``, eager sharded, unsharded with torch's own compiled step) results,
    the graph breaks and graphs of each compiled step, and whether each step moved the shards' version counters
    (a held gather is told stale by them)."""
    import torch._dynamo

    def compiled_run(model, sharded: bool) -> tuple:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        result = _train(model, model, batches, sharded=sharded, optimizer=optimizer, step_backend=backend)
        counters = torch._dynamo.utils.counters
        return result, (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])

    model = _gpt(True)
    batches = _batches(world)
    reference, plain_graphs = compiled_run(copy.deepcopy(model), sharded=False)
    eager = shardtensor.shard_module(copy.deepcopy(model))
    eager_result = _train(eager, eager, batches, sharded=True, optimizer=optimizer)
    versions, real_step_ends = [], traced.optimizer_step_ends

    def step_ends(params):
        before = [p._local._version for p in params]
        real_step_ends(params)
        versions.append(all(p._local._version > v for p, v in zip(params, before)))

    traced.optimizer_step_ends = step_ends
    try:
        result, graphs = compiled_run(shardtensor.shard_module(model), sharded=True)
    finally:
        traced.optimizer_step_ends = real_step_ends
    return result, eager_result, reference, graphs, plain_graphs, versions


@pytest.mark.parametrize("optimizer,backend", [("adamw", "inductor"), ("adamw-foreach", "aot_eager"),
                                               ("adamw-fused", "aot_eager"), ("sgd-momentum", "aot_eager")])
def test_a_compiled_optimizer_step_updates_the_shards_as_the_eager_step(optimizer, backend):
    """``torch.compile(opt.step)``: the update runs on each rank's rows in the graphs torch compiles for the
    unsharded model's step (it was refused: an in-place write into a ShardedParam in compiled code; the fused
    step is one torch does not trace, and runs eagerly), the step hooks stay eager, and the parameters after 3
    steps are the eager sharded ones and the unsharded ones."""
    for result, eager, reference, (breaks, graphs), (plain_breaks, plain_graphs), versions in run_on_ranks(
            2, compiled_optimizer_step_case, 2, optimizer, backend):
        assert graphs == plain_graphs and breaks <= plain_breaks, ((breaks, graphs), (plain_breaks, plain_graphs))
        assert versions == [True] * STEPS, versions
        _assert_same(result, eager, 1e-5)
        _assert_same(result, reference, 1e-4)


def write_outside_a_step_case() -> str:
    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Linear(4, 6))

    @torch.compile(backend="aot_eager", fullgraph=True)
    def ema(decay: float) -> None:
        with torch.no_grad():
            model.weight.mul_(decay)

    try:
        ema(0.5)
    except Exception as exc:  # noqa: BLE001  (Dynamo wraps the error it met)
        return str(exc)
    return "no error"


def test_an_in_place_write_in_compiled_code_outside_an_optimizer_step_is_refused():
    """Only an optimizer step's writes run on the traced shards: elsewhere the compiled graph's write would not
    move the version counters a held gather is checked against."""
    for text in run_on_ranks(2, write_outside_a_step_case):
        assert "writes into the sharded tensors ['weight']" in text and "torch.compile(opt.step)" in text, text


def whole_step_case(gather: str) -> tuple:
    """(compiled, eager) results of one compiled function holding the forward, ``loss.backward()``, clipping and
    the optimizer step, and its graph breaks."""
    import torch._dynamo

    def train(compiled: bool) -> tuple:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model = shardtensor.shard_module(_gpt(True), gather=gather)
        opt = OPTIMIZERS["adamw"](model.parameters())

        def train_step(idx: torch.Tensor) -> torch.Tensor:
            loss = _loss(model, idx)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        losses = [step(batch[dist.get_rank()]).item() for batch in _batches(2)]
        state = {k: v.detach().clone() for k, v in shardtensor.full_state_dict(model).items()}
        return (losses, state), sum(torch._dynamo.utils.counters["graph_break"].values())

    (compiled, breaks), (eager, _) = train(True), train(False)
    return compiled, eager, breaks


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_a_compiled_function_holding_backward_and_the_step_trains_as_eager(gather):
    """``loss.backward()`` inside a compiled function is a graph break, after which autograd called our gradient
    hooks and the compiler rebuilt ShardedParams, both as frames Dynamo traced: it failed inside them ("Expect
    size to be a plain tuple of ints"; then a symbolic size "not tracked with proxy"); they run eagerly now (see
    [Note: backward hooks run eagerly]), and the step in the same function compiles."""
    for compiled, eager, breaks in run_on_ranks(2, whole_step_case, gather):
        assert breaks >= 1  # (the backward)
        _assert_same(compiled, eager, 1e-5)
