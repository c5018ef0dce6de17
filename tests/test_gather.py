"""Gather accounting: what is alive when, prefetching in the recorded order, and re-recording on a change."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from rank_pool import run_on_ranks


def _gpt(seed: int = 0):
    from shardtensor.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16))


def _tokens(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 37, (2, 8), generator=g), torch.randint(0, 37, (2, 8), generator=g)


def sequential_lifetimes() -> dict:
    """Per rank: the most gathered buffers the Gatherer held at once, and how many survive forward."""
    import shardtensor

    model = shardtensor.shard_module(_gpt(), gather="sequential")
    gatherer = model._shardtensor.gatherer
    x, y = _tokens(1)
    loss = model(x, y)
    gatherer.drop_cache()  # the reuse window may keep the tied embedding for backward's first op
    gc.collect()
    alive_after_forward = gatherer.alive_buffers()
    loss.backward()
    gatherer.drop_cache()
    gc.collect()
    full_is_shard = True
    for p in model.parameters():
        full = gatherer.acquire(p)
        full_is_shard &= full.data_ptr() == p.to_local().data_ptr()
        gatherer.release(p)
        del full
    gatherer.drop_cache()
    return {"max_alive": gatherer.max_alive, "alive_after_forward": alive_after_forward,
            "alive_after_backward": gatherer.alive_buffers(), "gathers": gatherer.gathers,
            "full_is_shard": full_is_shard}


@pytest.mark.parametrize("world", [1, 2])
def test_sequential_gather_holds_one_full_param(world):
    for r in run_on_ranks(world, sequential_lifetimes):
        assert r["gathers"] > 0
        if world == 1:  # nothing is gathered: every "full" tensor is its shard, so ops take all their params at once
            assert r["full_is_shard"] and r["max_alive"] <= 3, r
        else:
            assert r["max_alive"] == 1, r
        # Nothing saved for backward holds a gathered buffer: autograd saved views of the shards instead.
        assert r["alive_after_forward"] == 0, r
        assert r["alive_after_backward"] == 0, r


def overlapped_prefetch(change_branch: bool) -> dict:
    import shardtensor

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(6, 6), "b": nn.Linear(6, 6), "c": nn.Linear(6, 3)})
    shardtensor.shard_module(model, gather="overlapped", prefetch_bytes=1 << 20)
    gatherer = model._shardtensor.gatherer
    x = torch.randn(4, 6)

    def step(use_b: bool):
        gatherer.step_begin()  # a ModuleDict has no forward: mark the step as the root forward hook would
        h = model["a"](x)
        if use_b:
            h = model["b"](h)
        model["c"](h).sum().backward()

    step(True)
    first_order = list(gatherer.recorded_order)
    hits_before = gatherer.prefetch_hits
    step(True)
    hits_after_replay = gatherer.prefetch_hits
    step(not change_branch)
    step(not change_branch)
    return {"order": first_order, "hits_first": hits_before, "hits_replay": hits_after_replay - hits_before,
            "mismatches": gatherer.mismatches, "order_after": list(gatherer.recorded_order)}


@pytest.mark.parametrize("world", [1, 2])
def test_overlapped_prefetches_in_recorded_order(world):
    for r in run_on_ranks(world, overlapped_prefetch, False):
        assert [name.split(".")[0] for name in r["order"][:6]] == ["a", "a", "b", "b", "c", "c"], r["order"]
        assert "c.weight" in r["order"][6:], "backward gathers are recorded too"
        assert r["hits_first"] == 0  # nothing to prefetch while recording
        if world > 1:
            assert r["hits_replay"] > 0
        else:  # a world of one gathers by aliasing the shard: nothing to prefetch
            assert r["hits_replay"] == 0
        assert r["mismatches"] == 0


def test_overlapped_detects_a_changed_order_and_rerecords():
    for r in run_on_ranks(2, overlapped_prefetch, True):
        assert r["mismatches"] >= 1
        assert "b.weight" not in r["order_after"], r["order_after"]


def accumulation_matches_large_batch(gather: str) -> float:
    """Two backward passes on halves of a batch before step() == one pass on the whole (mean loss)."""
    import copy

    import shardtensor
    from shardtensor import _comm

    world, rank = _comm.world_size(), _comm.rank()
    model = _gpt(3)
    reference = copy.deepcopy(model)
    shardtensor.shard_module(model, gather=gather)
    batches = [_tokens(10 + i) for i in range(2 * world)]
    mine = batches[2 * rank: 2 * rank + 2]
    for x, y in mine:
        (model(x, y) / 2).backward()
    (sum(reference(x, y) for x, y in batches) / len(batches)).backward()
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor()
        worst = max(worst, (grad - q.grad).abs().max().item())
    return worst


@pytest.mark.parametrize("world,gather", [(1, "sequential"), (2, "overlapped"), (4, "sequential")])
def test_gradient_accumulation_equals_large_batch(world, gather):
    assert max(run_on_ranks(world, accumulation_matches_large_batch, gather)) < 1e-6


def auto_mode_switch() -> tuple[int, int]:
    import shardtensor

    torch.manual_seed(0)
    model = shardtensor.shard_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)), gather="auto",
                                     min_free_bytes=1000)
    gatherer = model._shardtensor.gatherer
    free = {"bytes": 10_000}
    gatherer.auto.free_memory_fn = lambda device: free["bytes"]
    x = torch.randn(3, 4)
    for _ in range(2):
        model(x).sum().backward()
    plenty = gatherer.prefetches
    free["bytes"] = 10  # memory pressure: no more prefetching
    for _ in range(2):
        model(x).sum().backward()
    return plenty, gatherer.prefetches - plenty


def test_auto_mode_stops_prefetching_under_memory_pressure():
    for plenty, under_pressure in run_on_ranks(2, auto_mode_switch):
        assert plenty > 0
        assert under_pressure == 0


def auto_mode_one_rank_low(low_steps: tuple) -> dict:
    """Only rank 0's memory runs low (ranks share a host unevenly), in the steps ``low_steps``: every rank must
    switch with it (each mode issues its own collectives), and the numbers stay those of overlapped mode."""
    import shardtensor

    results = {}
    for gather in ("auto", "overlapped"):
        torch.manual_seed(0)
        model = shardtensor.shard_module(
            nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))), gather=gather,
            min_free_bytes=1000)
        gatherer, step = model._shardtensor.gatherer, [0]
        gatherer.auto.free_memory_fn = lambda device: 10 if _comm_rank() == 0 and step[0] in low_steps else 10_000
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(7 + _comm_rank())
        modes = []
        for step[0] in range(5):
            model(torch.randn(3, 4, generator=gen)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            modes.append(gatherer.auto.pressure)
        results[gather] = ({n: p.full_tensor() for n, p in model.named_parameters()}, modes)
    (auto, modes), (overlapped, _) = results["auto"], results["overlapped"]
    return {"modes": modes, "off": max((auto[n] - overlapped[n]).abs().max().item() for n in auto)}


def _comm_rank() -> int:
    return torch.distributed.get_rank()


@pytest.mark.parametrize("low_steps", [(1, 2, 3, 4), (2,)])
def test_auto_mode_switches_on_every_rank_when_one_runs_low(low_steps):
    results = run_on_ranks(2, auto_mode_one_rank_low, low_steps)
    assert results[0]["modes"] == results[1]["modes"], results  # the same schedule on both ranks
    assert any(results[0]["modes"]), results  # it did switch to sequential
    assert all(r["off"] < 1e-6 for r in results), results


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


class _FailOnce(nn.Module):
    """Identity whose backward raises while ``armed``: a failure inside a gather unit's backward."""

    armed = False

    def forward(self, x):
        return _FailingBackward.apply(x) if self.armed else x


def gradients_after_a_failed_backward(inside_unit: bool, zero_grad: bool = True) -> float:
    """A backward that raises after some reductions were issued (or, inside a unit, after some of the unit's
    gradients were stashed) must not leave them unfinished, or finish them into the next step's gradients.
    ``zero_grad=False``: the next backward accumulates onto what the failed one left (zero placeholders, which
    must be writable: see [Note: a lazy placeholder]), and the gradients take in-place edits."""
    import shardtensor

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), _FailOnce(), nn.Linear(6, 2)))

    model, reference = shardtensor.shard_module(build(), gather="overlapped"), build()
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="on purpose"):
        if inside_unit:
            model[1][1].armed = True
            model(x).sum().backward()
        else:
            model[1](_FailingBackward.apply(model[0](x))).sum().backward()
    model[1][1].armed = False
    if zero_grad:
        model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    reference(x).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # in place on every .grad (a factor of 1)
    return max((p.grad.full_tensor() - q.grad).abs().max().item()
               for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.parametrize("inside_unit,zero_grad", [(False, True), (True, True), (True, False)])
def test_a_failed_backward_leaves_no_half_reduced_gradients(inside_unit, zero_grad):
    assert max(run_on_ranks(2, gradients_after_a_failed_backward, inside_unit, zero_grad)) < 1e-6


def _worst_gradient_difference(model, reference, steps: tuple) -> float:
    """Backwards on ``_tokens(step)`` for each step, from zero gradients: the largest gradient difference seen."""
    worst = 0.0
    for step in steps:
        model.zero_grad()
        reference.zero_grad()
        model(*_tokens(step)).backward()
        reference(*_tokens(step)).backward()
        worst = max([worst] + [(p.grad.full_tensor() - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), reference.parameters())])
    return worst


def gradients_after_a_gradient_hook_raised(block: int, gather: str) -> float:
    """A user's gradient hook on a block's weight raises (a NaN check) during the backward, on every rank; the
    loop catches it, removes the hook and calls ``zero_grad()``.  In overlapped mode the first block's reduction
    is the last one finished, inside the end-of-backward callback, after the root unit's reduction was issued:
    that callback raising left the root's reduction in flight and the backward counted as ended, so the next
    step's root gradients took the failed step's too (2x off, silently)."""
    import shardtensor

    model, reference = shardtensor.shard_module(_gpt(), gather=gather), _gpt()

    def nan_check(grad):
        raise ValueError("non-finite gradient (on purpose)")

    handle = model.blocks[block].fc.weight.register_hook(nan_check)
    with pytest.raises(ValueError, match="on purpose"):
        model(*_tokens(0)).backward()
    handle.remove()
    model.zero_grad()
    return _worst_gradient_difference(model, reference, steps=(1, 2))  # the next step, and the one after


@pytest.mark.parametrize("block,gather", [(0, "overlapped"), (1, "overlapped"), (0, "sequential")])
def test_a_gradient_hook_that_raised_leaves_no_gradient_for_the_next_step(block, gather):
    # The same batch on every rank: the reference is the unsharded model on it.
    assert max(run_on_ranks(2, gradients_after_a_gradient_hook_raised, block, gather)) < 1e-6


def gradients_after_an_inference_mode_forward_stopped_early() -> float:
    """An evaluation under ``torch.inference_mode()`` that stops after the first block (a hook raising on every
    rank; reading a middle layer's features does the same): the next block's prefetched gather, issued inside
    inference mode, was never taken.  Its buffers were inference tensors, and the shared-memory channel's copy
    into them, at the next collective outside inference mode, raised there and at every collective after it."""
    import shardtensor

    model, reference = shardtensor.shard_module(_gpt(), gather="overlapped"), _gpt()
    model(*_tokens(0)).backward()  # a step records the order: the eval's forward then prefetches
    model.zero_grad()

    def stop(module, args, output):
        raise ValueError("evaluation stopped (on purpose)")

    handle = model.blocks[0].register_forward_hook(stop)
    with torch.inference_mode(), pytest.raises(ValueError, match="on purpose"):
        model(*_tokens(1))
    handle.remove()
    return _worst_gradient_difference(model, reference, steps=(2, 3))


def test_training_goes_on_after_an_inference_mode_forward_that_stopped_early():
    assert max(run_on_ranks(2, gradients_after_an_inference_mode_forward_stopped_early)) < 1e-6


def gatherer_bookkeeping_sizes(steps: int) -> int:
    import shardtensor

    model = shardtensor.shard_module(_gpt(), gather="overlapped", units=False)  # per-op gathers: their accounting
    for i in range(steps):
        x, y = _tokens(i)
        model(x, y).backward()
    gc.collect()
    gatherer = model._shardtensor.gatherer
    return len(gatherer._alive_refs), gatherer.gathers // steps


@pytest.mark.parametrize("world", [1, 2])
def test_gather_bookkeeping_does_not_grow_with_steps(world):
    """The lifetime accounting keeps one weak reference per gather; a long run must not accumulate them."""
    short, per_step = max(run_on_ranks(world, gatherer_bookkeeping_sizes, 2))
    long, _ = max(run_on_ranks(world, gatherer_bookkeeping_sizes, 12))
    assert long <= short, (short, long)
    if world > 1:  # the accounting is live (not trivially empty): the last step's gathers are still listed
        assert 0 < long <= per_step, (long, per_step)
    else:  # world 1 hands out the shard itself (it is the full tensor): no gathered buffer to account for
        assert short == long == 0, (short, long)


def container_steps(steps: int, failed_backward_first: bool = False) -> dict:
    """A root without a forward (a ModuleDict) whose children are called directly, and nobody marks the steps.
    ``failed_backward_first``: a backward that raises comes first (its end-of-backward callback never runs)."""
    import shardtensor

    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(6, 6), "b": nn.Linear(6, 3)})
    shardtensor.shard_module(model, gather="overlapped", prefetch_bytes=1 << 20)
    gatherer = model._shardtensor.gatherer
    x = torch.randn(4, 6)
    if failed_backward_first:
        with pytest.raises(RuntimeError, match="on purpose"):
            model["b"](_FailingBackward.apply(model["a"](x))).sum().backward()
        model.zero_grad()
    lengths = []
    for _ in range(steps):
        model["b"](model["a"](x)).sum().backward()
        lengths.append(len(gatherer.recorded_order))
    return {"lengths": lengths, "hits": gatherer.prefetch_hits, "mismatches": gatherer.mismatches}


@pytest.mark.parametrize("failed_backward_first", [False, True])
def test_a_container_root_replays_its_order_with_bounded_bookkeeping(failed_backward_first):
    # The end of each backward marks the step: the order is recorded once, replayed (prefetching) after that,
    # and the bookkeeping stops growing (before, it grew by one step's gathers per step and never prefetched).
    # After a backward that raised too (its end callback never ran: no later backward's end was marked).
    for r in run_on_ranks(2, container_steps, 6, failed_backward_first):
        assert len(set(r["lengths"][1:])) == 1, r
        assert r["hits"] > 0, r
        assert r["mismatches"] == 0, r


class _NormedLatents(nn.Module):
    """A sharded parameter normalised by a LayerNorm whose affine parameters are absent or kept whole (Perceiver's
    latents; ``nn.LayerNorm(bias=False)``)."""

    def __init__(self, bias: bool):
        super().__init__()
        self.latents = nn.Parameter(torch.randn(5, 8, dtype=torch.float64))
        self.ln = nn.LayerNorm(8, bias=bias, dtype=torch.float64)

    def forward(self, x):
        return (self.ln(self.latents) @ x.T).tanh().square().mean()


def normed_latents_case(mode: str, bias: bool) -> float:
    import copy

    import shardtensor

    torch.manual_seed(0)
    plain = _NormedLatents(bias)
    model = shardtensor.shard_module(copy.deepcopy(plain), gather=mode)  # the LayerNorm's 8 elements: kept whole
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    xs = [torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    model(xs[rank]).backward()
    for x in xs:
        (plain(x) / world).backward()
    grads = dict(model.named_parameters())
    return max(((g.grad.full_tensor() if isinstance(g, shardtensor.ShardedParam) else g.grad) - grads_ref).abs().max().item()
               for (name, g), grads_ref in zip(grads.items(), [p.grad for p in plain.parameters()]))


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm_of_a_sharded_tensor_with_whole_or_no_affine_parameters(mode, bias):
    """Helper H: sequential mode split every layer_norm into the normalisation and one gathered parameter at a
    time, and took the weight and bias for sharded ones: ``AttributeError: 'NoneType' object has no attribute
    '_gatherer'`` with ``bias=False`` (and for a plain one) where overlapped mode computed the right result."""
    for diff in run_on_ranks(2, normed_latents_case, mode, bias):
        assert diff < 1e-12, diff
