"""Gradient hooks see the reduced gradient, also where the reduction lands after AccumulateGrad.

A gather unit (every block in overlapped mode) and ``gradient_sync(model, False)`` hand AccumulateGrad a zero
placeholder and add the reduced rows later (see [Note: gradient hooks run when the gradient lands]).  A hook that
ran on the placeholder would read zeros: an optimizer stepping in backward would step on nothing, a clamp would
clamp zeros and let the real rows through.  These tests compare what every hook saw with the gradient ``.grad``
holds after backward, against the unsharded model's gradients with the same clamp.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rank_pool import run_on_ranks


CLAMP = 0.02  # below most gradient entries here: a clamp that misses the reduced rows shows


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, dim: int = 8, blocks: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _hooks_case(gather: str, micro_batches: int) -> dict:
    """Every hook call's copy of the gradient shard, against ``.grad`` at the end and the unsharded gradient."""
    import shardtensor

    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    shardtensor.shard_module(model, gather=gather)
    seen: dict[str, list] = {name: [] for name, _ in model.named_parameters()}
    clamped: dict[str, list] = {name: [] for name, _ in model.named_parameters()}

    def clamp(grad, name):  # a tensor hook that edits the gradient: its result is what lands
        clamped[name].append(grad.to_local().abs().max().item())
        return grad.clamp(-CLAMP, CLAMP)

    for name, p in model.named_parameters():
        p.register_hook(lambda g, name=name: clamp(g, name))
        p.register_post_accumulate_grad_hook(lambda q, name=name: seen[name].append(q.grad.to_local().clone()))
        p.register_post_accumulate_grad_hook(lambda q, name=name: seen[name].append(q.grad.to_local().clone()))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(world * 4, 8, generator=gen) for _ in range(micro_batches)]
    for i, batch in enumerate(batches):
        with shardtensor.gradient_sync(model, i == micro_batches - 1):
            model(batch[rank * 4:(rank + 1) * 4]).square().mean().backward()
    for batch in batches:  # the unsharded model sees every rank's rows: the mean of the ranks' means
        reference(batch).square().mean().backward()
    out = {"calls": {}, "stale": [], "off": 0.0, "clamp_calls": {n: len(v) for n, v in clamped.items()},
           "clamp_saw_only_zeros": [n for n, v in clamped.items() if v and max(v) == 0.0]}
    grads = dict(model.named_parameters())
    for name, ref in reference.named_parameters():
        final = grads[name].grad.to_local()
        out["calls"][name] = len(seen[name])
        out["stale"] += [name for value in seen[name] if not torch.equal(value, final)]
        expected = ref.grad.clamp(-CLAMP, CLAMP)
        out["off"] = max(out["off"], (grads[name].grad.full_tensor() - expected).abs().max().item())
    return out


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_gradient_hooks_see_the_reduced_gradient(gather, micro_batches):
    for r in run_on_ranks(2, _hooks_case, gather, micro_batches):
        assert r["stale"] == [], r  # a hook saw a placeholder (zeros) or a partial gradient
        assert set(r["calls"].values()) == {2}, r  # each of 2 hooks once per synced backward, never when deferred
        assert set(r["clamp_calls"].values()) == {1} and r["clamp_saw_only_zeros"] == [], r
        assert r["off"] < 1e-6, r


def _clamp_alone_case(gather: str, persist_numel: int) -> float:
    """A clamping ``register_hook`` and no other hook (the README's example): off from the unsharded clamp."""
    import shardtensor

    torch.manual_seed(0)
    reference = Net()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=gather, persist_numel=persist_numel)
    for p, q in zip(model.parameters(), reference.parameters()):
        p.register_hook(lambda g: g.clamp(-CLAMP, CLAMP))
        q.register_hook(lambda g: g.clamp(-CLAMP, CLAMP))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = torch.randn(world * 4, 8, generator=torch.Generator().manual_seed(3))
    model(batch[rank * 4:(rank + 1) * 4]).square().mean().backward()
    reference(batch).square().mean().backward()
    off = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        grad = p.grad.full_tensor() if isinstance(p.grad, shardtensor.ShardedParam) else p.grad
        off = max(off, (grad - q.grad).abs().max().item())
    return off


@pytest.mark.parametrize("gather,persist_numel", [("overlapped", 0), ("overlapped", 40), ("sequential", 0)])
def test_a_clamping_hook_alone_sees_the_reduced_gradient(gather, persist_numel):
    """The overlapped reduce-scatter (and the deferred average of a replicated parameter) hands AccumulateGrad a
    gradient still being filled; a user's hook after ours must not read it (it clamped uninitialised memory)."""
    for off in run_on_ranks(2, _clamp_alone_case, gather, persist_numel):
        assert off < 1e-6, off


def _optimizer_in_backward_case(gather: str) -> float:
    """PyTorch's optimizer-in-backward idiom (one AdamW per parameter, stepped by its post-accumulate-grad hook)
    against the usual loop, on the same sharded model: the hooks must step on the reduced gradients."""
    import shardtensor

    params = {}
    for mode in ("in_backward", "loop"):
        torch.manual_seed(0)
        model = shardtensor.shard_module(Net(), gather=gather)
        if mode == "in_backward":
            opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(lambda q: (opts[q].step(), opts[q].zero_grad()))
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(5 + torch.distributed.get_rank())
        for _ in range(3):
            model(torch.randn(4, 8, generator=gen)).square().mean().backward()
            if mode == "loop":
                opt.step()
                opt.zero_grad()
        params[mode] = [p.detach().to_local().clone() for p in model.parameters()]
    return max((a - b).abs().max().item() for a, b in zip(params["in_backward"], params["loop"]))


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_optimizer_in_backward_equals_the_usual_loop(gather):
    assert run_on_ranks(2, _optimizer_in_backward_case, gather) == [0.0, 0.0]


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, use_head: bool):
        h = torch.tanh(self.body(x))
        return self.head(h) if use_head else h


def _flushed_case() -> dict:
    """``head`` is used only in the deferred micro-batch: its gradient is reduced when the synced backward ends
    (``flush_deferred``), and its hooks must run on that reduced gradient, once."""
    import shardtensor

    torch.manual_seed(0)
    reference = TwoHeads()
    model = shardtensor.shard_module(copy.deepcopy(reference))
    calls = {"tensor": 0, "post": 0}

    def clamp(g):
        calls["tensor"] += 1
        return g.clamp(-CLAMP, CLAMP)

    for p in model.head.parameters():
        p.register_hook(clamp)
        p.register_post_accumulate_grad_hook(lambda q: calls.__setitem__("post", calls["post"] + 1))
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x = torch.randn(world * 4, 8, generator=torch.Generator().manual_seed(2))
    for use_head in (True, False):
        with shardtensor.gradient_sync(model, not use_head):
            model(x[rank * 4:(rank + 1) * 4], use_head).square().mean().backward()
        reference(x, use_head).square().mean().backward()
    off = max((p.grad.full_tensor() - q.grad.clamp(-CLAMP, CLAMP)).abs().max().item()
              for p, q in zip(model.head.parameters(), reference.head.parameters()))
    return dict(calls=calls, off=off)


def test_hooks_of_a_gradient_flushed_at_the_end_of_a_synced_backward():
    for r in run_on_ranks(2, _flushed_case):
        assert r["calls"] == {"tensor": 2, "post": 2} and r["off"] < 1e-6, r  # weight and bias, once each


def _autograd_grad_case(gather: str, persist_numel: int) -> dict:
    """``torch.autograd.grad`` w.r.t. sharded parameters returns this rank's own full gradient (as under DDP) and
    leaves ``.grad`` alone; a gradient penalty built on it (``create_graph=True``) then trains like DDP's."""
    import shardtensor

    torch.manual_seed(0)
    reference = Net().double()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=gather, persist_numel=persist_numel)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randn(4, 8, generator=gen, dtype=torch.float64) for _ in range(world)]

    def penalised(net, x):
        params = list(net.parameters())
        loss = net(x).square().mean()
        grads = torch.autograd.grad(loss, params, create_graph=True)
        return loss + 0.1 * sum(g.square().sum() for g in grads), grads

    out: dict = {}
    mine = torch.autograd.grad(model(batches[rank]).square().mean(), list(model.parameters()))
    theirs = torch.autograd.grad(reference(batches[rank]).square().mean(), list(reference.parameters()))
    out["types"] = sorted({type(g).__name__ for g in mine})
    out["local_off"] = max((a - b).abs().max().item() for a, b in zip(mine, theirs))
    out["grad_left"] = [n for n, p in model.named_parameters() if p.grad is not None]
    loss, _ = penalised(model, batches[rank])
    loss.backward()
    for x in batches:  # DDP's result: the mean over ranks of each rank's penalised gradient
        (penalised(reference, x)[0] / world).backward()
    grads = dict(model.named_parameters())
    out["penalty_off"] = max(
        ((grads[n].grad.full_tensor() if isinstance(grads[n], shardtensor.ShardedParam) else grads[n].grad)
         - p.grad).abs().max().item() for n, p in reference.named_parameters())
    return out


@pytest.mark.parametrize("gather,persist_numel", [("overlapped", 0), ("sequential", 0), ("overlapped", 10)])
def test_autograd_grad_returns_this_ranks_gradient_and_leaves_grad_alone(gather, persist_numel):
    for r in run_on_ranks(2, _autograd_grad_case, gather, persist_numel):
        assert r["types"] == ["Tensor"], r  # plain full tensors, as the unsharded model's
        assert r["local_off"] < 1e-12, r
        assert r["grad_left"] == [], r
        assert r["penalty_off"] < 1e-12, r


def _assigned_grad_case() -> dict:
    """``p.grad = g`` with ``g`` from ``torch.autograd.grad`` (each rank's own full gradient), then a step."""
    import shardtensor

    torch.manual_seed(0)
    model = shardtensor.shard_module(Net())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    before = [p.to_local().clone() for p in model.parameters()]
    try:
        opt.step()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    return {"message": message, "unchanged": all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))}


def test_a_full_gradient_assigned_to_grad_is_named_at_the_step():
    """The refusal named only a frozen or converted parameter, not the assignment the user made."""
    for r in run_on_ranks(2, _assigned_grad_case):
        assert "assigned to .grad" in r["message"] and "call backward" in r["message"] and r["unchanged"], r


def _backward_create_graph_case(gather: str, persist_numel: int, sync: bool) -> dict:
    """``loss.backward(create_graph=True)`` then a penalty on ``.grad`` (a gradient-norm regulariser)."""
    import shardtensor

    torch.manual_seed(0)
    reference = Net().double()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=gather, persist_numel=persist_numel)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    out: dict = {}
    try:
        with shardtensor.gradient_sync(model, sync):  # (without sync .grad holds zeros: no graph either)
            model(x).square().mean().backward(create_graph=True)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    model.zero_grad()
    model(x).square().mean().backward()  # training goes on: the same batch on every rank, the unsharded gradient
    reference(x).square().mean().backward()
    grads = dict(model.named_parameters())
    out["off"] = max(((grads[n].grad.full_tensor() if isinstance(grads[n], shardtensor.ShardedParam)
                       else grads[n].grad) - p.grad).abs().max().item() for n, p in reference.named_parameters())
    return out


# A sharded .grad is this rank's shard of the mean: it cannot carry the graph create_graph=True asks for, and a
# penalty built on it added nothing to the next backward (gradients 2.1 off the unsharded model's, silently).
@pytest.mark.parametrize("gather,persist_numel,sync", [("overlapped", 0, True), ("sequential", 0, True),
                                                       ("overlapped", 10, True), ("sequential", 0, False)])
def test_backward_with_create_graph_is_named_with_the_autograd_grad_recipe(gather, persist_numel, sync):
    for r in run_on_ranks(2, _backward_create_graph_case, gather, persist_numel, sync):
        assert r["error"] is not None and "create_graph=True" in r["error"], r
        assert "torch.autograd.grad(loss, params, create_graph=True)" in r["error"], r
        assert r["off"] < 1e-12, r
