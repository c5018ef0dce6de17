"""Sharded training equals unsharded training on the concatenated batch.

Each rank trains on its own micro-batch; the reference (run on every rank, same seed) trains one unsharded
copy on all micro-batches with the mean loss, which is the concatenated batch for every model here (BatchNorm
included: the reference normalises each micro-batch separately, as each rank does).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from rank_pool import run_on_ranks

OPTIMIZERS = ["sgd", "adam", "adamw"]
IMPLS = ["forloop", "foreach", "fused"]


def make_optimizer(kind: str, impl: str, params, lr: float, dtype=torch.float64):
    # Adam's eps: attention's key bias has an identically zero gradient, so there both runs see only rounding
    # noise, and Adam divides it by its own magnitude: with eps far below the noise, two exact but differently
    # rounded runs take lr-sized steps of either sign.  In float64 the noise (~1e-17) is far below eps=1e-8; in
    # float32 (noise ~1e-9) eps=1e-5 keeps the comparison about sharding.  Real gradients are far above both.
    eps = 1e-8 if dtype == torch.float64 else 1e-5
    flags = {"forloop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[impl]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps, **flags)
    if kind in OTHER_OPTIMIZERS:
        return OTHER_OPTIMIZERS[kind](params, lr=lr, **flags)
    return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=0.1, **flags)


# The rest of torch.optim (LBFGS aside: its closure re-evaluates the loss), each through its own ops: Rprop writes
# ``grad[sign.eq(etaminus)] = 0`` (an index_put_ by a mask of the gradient's own placement), ASGD and Adagrad
# keep 0-d and full-shape states, RMSprop(centered) and Adam(amsgrad) extra buffers.
OTHER_OPTIMIZERS = {
    "rprop": torch.optim.Rprop, "adagrad": torch.optim.Adagrad, "adadelta": torch.optim.Adadelta,
    "adamax": torch.optim.Adamax, "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam, "asgd": torch.optim.ASGD,
    "rmsprop": lambda params, **kw: torch.optim.RMSprop(params, centered=True, momentum=0.5, **kw),
    "amsgrad": lambda params, **kw: torch.optim.Adam(params, amsgrad=True, **kw),
}


# ---------------------------------------------------------------------------------------------- models
def build_mlp(seed: int, widths: list[int]) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def mlp_batch(gen: torch.Generator, n: int, widths: list[int]):
    return (torch.randn(n, widths[0], generator=gen),), torch.randn(n, widths[-1], generator=gen)


class TinyTransformer(nn.Module):
    """Embedding tied to the output head, LayerNorm, attention through nn.MultiheadAttention."""

    def __init__(self, vocab: int, dim: int, heads: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))  # a 0-d parameter: replicated, grads averaged

    def forward(self, idx):
        x = self.emb(idx)
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.ln(x + a)
        x = x + self.ff(x)
        return self.head(x) / self.temperature


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with distinct query and key/value: the packed in_proj weight gets split (a view)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)

    def forward(self, q, kv):
        return self.attn(q, kv, kv, need_weights=False)[0]


class ConvNet(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1, bias=False)  # no bias before BatchNorm
        self.bn = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 5, 3)
        self.fc = nn.Linear(5, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = self.conv2(x).mean(dim=(2, 3))
        return self.fc(x)


def build(case: dict) -> nn.Module:
    return _build(case).to(case["dtype"])


def _build(case: dict) -> nn.Module:
    torch.manual_seed(case["seed"])
    kind = case["model"]
    if kind == "mlp":
        return build_mlp(case["seed"], case["widths"])
    if kind == "transformer":
        return TinyTransformer(case["vocab"], 8, 2)
    if kind == "mha":
        return CrossAttention(6, 2)
    if kind == "conv":
        return ConvNet(case["channels"])
    raise ValueError(kind)


def batch(case: dict, gen: torch.Generator, n: int):
    inputs, target = _batch(case, gen, n)
    cast = lambda t: t.to(case["dtype"]) if t.is_floating_point() else t  # noqa: E731
    return tuple(cast(t) for t in inputs), cast(target)


def _batch(case: dict, gen: torch.Generator, n: int):
    kind = case["model"]
    if kind == "mlp":
        return mlp_batch(gen, n, case["widths"])
    if kind == "transformer":
        idx = torch.randint(0, case["vocab"], (n, 5), generator=gen)
        return (idx,), torch.randint(0, case["vocab"], (n, 5), generator=gen)
    if kind == "mha":
        return (torch.randn(n, 3, 6, generator=gen), torch.randn(n, 4, 6, generator=gen)), torch.randn(n, 3, 6, generator=gen)
    if kind == "conv":
        return (torch.randn(n, 3, 6, 6, generator=gen),), torch.randint(0, 3, (n,), generator=gen)
    raise ValueError(kind)


def loss_fn(case: dict, out, target):
    if case["model"] == "transformer":
        return nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())
    if case["model"] == "conv":
        return nn.functional.cross_entropy(out, target)
    return (out - target).square().mean()


# ---------------------------------------------------------------------------------------------- per rank
def train_and_compare(case: dict) -> float:
    """Runs on every rank: sharded training vs the unsharded reference; returns the max parameter difference."""
    import shardtensor
    from shardtensor import _comm

    world, rank = _comm.world_size(), _comm.rank()
    model = build(case)
    reference = copy.deepcopy(model)
    shardtensor.shard_module(model, gather=case["gather"], persist_numel=case.get("persist", 0))
    if case.get("persist"):  # small parameters stay whole on every rank, the rest is sharded
        for p in model.parameters():
            assert isinstance(p, shardtensor.ShardedParam) == (p.dim() > 0 and p.numel() >= case["persist"])
    opt = make_optimizer(case["opt"], case["impl"], model.parameters(), case["lr"], case["dtype"])
    ref_opt = make_optimizer(case["opt"], case["impl"], reference.parameters(), case["lr"], case["dtype"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    for _step in range(3):
        micro = [batch(case, gen, case["micro"]) for _ in range(world)]
        inputs, target = micro[rank]
        loss_fn(case, model(*inputs), target).backward()
        ref_loss = sum(loss_fn(case, reference(*i), t) for i, t in micro) / world
        ref_loss.backward()
        if case["clip"] is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), case["clip"])
            assert abs(norm.item() - ref_norm.item()) <= 1e-4 * max(1.0, ref_norm.item()), (norm, ref_norm)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    worst = 0.0
    for name, value in expected.items():
        if value.is_floating_point() and "running" not in name:
            worst = max(worst, (full[name] - value).abs().max().item())
    return worst


def cases(world: int, impl: str = None):
    """One drawn configuration at a fixed world size (the world is a parameter, so each size gets its share of
    examples; hypothesis' own draws were 8 of 12 at world 1)."""
    return st.fixed_dictionaries({
        "seed": st.integers(0, 10_000),
        "world": st.just(world),
        "gather": st.sampled_from(["sequential", "overlapped"]),
        "opt": st.sampled_from(OPTIMIZERS),
        "impl": st.just(impl) if impl else st.sampled_from(IMPLS),
        "lr": st.sampled_from([1e-3, 1e-2]),
        "clip": st.sampled_from([None, 0.05, 1.0]),
        "micro": st.integers(1, 3),
        "dtype": st.sampled_from([torch.float32, torch.float64]),
    })


# Few examples per world size: the property runs at three sizes, each draw trains two models for 3 steps.
PROPERTY = settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
WORLDS = pytest.mark.parametrize("world", [1, 2, 4])


def _check(case: dict) -> None:
    worst = max(run_on_ranks(case["world"], train_and_compare, case))
    assert worst <= 1e-5, f"max |sharded - unsharded| = {worst:.3g} for {case}"


@WORLDS
@PROPERTY
@given(data=st.data(), widths=st.lists(st.integers(1, 9), min_size=2, max_size=4))
def test_mlp_parity(world, data, widths):
    """Random widths: rows not divisible by the world size, and 1-row weights / 1-element biases."""
    _check({**data.draw(cases(world)), "model": "mlp", "widths": widths})


@WORLDS
@PROPERTY
@given(data=st.data(), vocab=st.integers(3, 11))
def test_tied_transformer_parity(world, data, vocab):
    _check({**data.draw(cases(world)), "model": "transformer", "vocab": vocab})


@WORLDS
@PROPERTY
@given(data=st.data(), channels=st.integers(2, 7))
def test_conv_batchnorm_parity(world, data, channels):
    _check({**data.draw(cases(world)), "model": "conv", "channels": channels})


@pytest.mark.parametrize("world,impl", [(1, "fused"), (2, "fused"), (2, "foreach"), (4, "forloop"), (4, "fused")])
@settings(PROPERTY, max_examples=2)
@given(data=st.data())
def test_multihead_attention_parity(world, impl, data):
    """Each optimizer implementation is drawn, the fused one at every world size."""
    _check({**data.draw(cases(world, impl)), "model": "mha"})


@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gather", ["sequential", "overlapped"])
def test_every_optimizer_form_on_two_ranks(opt, impl, gather):
    """The grid the property draws from, each cell once (world 2, odd widths, clipping on)."""
    _check({"seed": 7, "world": 2, "gather": gather, "opt": opt, "impl": impl, "lr": 1e-2, "clip": 0.5,
            "micro": 2, "model": "mlp", "widths": [5, 3, 1], "dtype": torch.float32})


@pytest.mark.parametrize("opt", sorted(OTHER_OPTIMIZERS))
@pytest.mark.parametrize("impl", ["forloop", "foreach"])
def test_every_other_stock_optimizer_on_two_ranks(opt, impl):
    _check({"seed": 7, "world": 2, "gather": "overlapped", "opt": opt, "impl": impl, "lr": 1e-2, "clip": 0.5,
            "micro": 2, "model": "mlp", "widths": [5, 3, 1], "dtype": torch.float64})


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model", ["transformer", "conv"])
def test_persisted_small_parameters_parity(world, model):
    """``persist_numel``: biases and norm weights stay replicated (averaged in one flat all-reduce)."""
    _check({"seed": 3, "world": world, "gather": "overlapped", "opt": "adamw", "impl": "foreach", "lr": 1e-2,
            "clip": 0.5, "micro": 2, "model": model, "vocab": 7, "channels": 4, "dtype": torch.float64,
            "persist": 20})


def _world1_gradient_aliasing() -> dict:
    """At world 1 the hook keeps autograd's gradient instead of copying it, under AccumulateGrad's rule."""
    import shardtensor

    made = []

    class Double(torch.autograd.Function):  # its backward's output is a fresh tensor only the engine holds
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, g):
            out = g * 2.0
            made.append(out.data_ptr())
            return out

    torch.manual_seed(0)
    layer = shardtensor.shard_module(nn.Linear(5, 4))
    Double.apply(layer.weight).square().sum().backward()
    fresh_kept = made == [layer.weight.grad.to_local().data_ptr()]
    # One gradient tensor reaching two leaves (``p.t() + q`` and ``p + r``, both orders): the first to arrive
    # sees the other's reference and copies, so no two .grads share memory, and the values are the plain ones.
    out = {"fresh_kept": fresh_kept, "shared": [], "values_equal": True}
    for order in range(2):
        params = nn.ParameterDict({"p": nn.Parameter(torch.randn(3, 4)), "q": nn.Parameter(torch.randn(4, 3)),
                                   "r": nn.Parameter(torch.randn(4, 3))})
        plain = copy.deepcopy(params)
        shardtensor.shard_module(params)
        for ps in (params, plain):
            p, q, r = ps["p"], ps["q"], ps["r"]
            y = (p.t() + q) if order == 0 else (q + p.t())
            ((y + r) * torch.arange(12.0).view(4, 3)).sum().backward()
        ptrs = [params[k].grad.to_local().untyped_storage().data_ptr() for k in "pqr"]
        out["shared"].append(len(set(ptrs)) < 3)
        for k in "pqr":
            params[k].grad.to_local().mul_(2.0)  # would double another .grad if memory were shared
        out["values_equal"] &= all(torch.equal(params[k].grad.to_local(), 2 * plain[k].grad) for k in "pqr")
    return out


def test_world1_gradients_are_not_copied_and_never_shared():
    r = run_on_ranks(1, _world1_gradient_aliasing)[0]
    assert r["fresh_kept"], r
    assert r["shared"] == [False, False], r
    assert r["values_equal"], r


def _shared_gradient_on_two_ranks(placement: str) -> float:
    """One gradient tensor reaching several leaves (two ShardedParams and a plain leaf, both orders): gloo's
    in-place reduce may use a gradient as scratch only when nobody else holds it."""
    import shardtensor
    from shardtensor import _comm

    worst = 0.0
    weights = [torch.arange(30.0).view(6, 5) * (k + 1) for k in range(2)]  # each rank's loss weights
    mean = (weights[0] + weights[1]) / 2
    for order in range(2):
        torch.manual_seed(order)
        module = shardtensor.shard_module(nn.ParameterDict({k: nn.Parameter(torch.randn(6, 5)) for k in "pq"}),
                                          placement=placement)
        p, q = module["p"], module["q"]
        r = torch.randn(6, 5, requires_grad=True)  # a plain leaf beside them keeps its local gradient
        y = (p + q + r) if order == 0 else (r + q + p)
        (y * weights[_comm.rank()]).sum().backward()
        worst = max(worst, (p.grad.full_tensor() - mean).abs().max().item(),
                    (q.grad.full_tensor() - mean).abs().max().item(),
                    (r.grad - weights[_comm.rank()]).abs().max().item())
    return worst


@pytest.mark.parametrize("placement", ["dim0", "layerwise"])
def test_shared_gradient_is_not_overwritten_by_the_reduction(placement):
    assert max(run_on_ranks(2, _shared_gradient_on_two_ranks, placement)) < 1e-6


def _clip_collectives() -> dict:
    import shardtensor
    from shardtensor import _comm

    torch.manual_seed(0)
    model = shardtensor.shard_module(build_mlp(0, [7, 5, 6, 3]))
    model(torch.randn(4, 7)).square().sum().backward()
    calls = []
    original = _comm.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    _comm.all_reduce = counting
    try:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # foreach left to torch's default
    finally:
        _comm.all_reduce = original
    return {"all_reduces": len(calls), "params": len(list(model.parameters())), "norm": norm.item()}


def test_clip_grad_norm_default_path_is_one_all_reduce():
    """ShardedParam is declared foreach-capable (as DTensor is): clip_grad_norm_'s default takes _foreach_norm."""
    for r in run_on_ranks(2, _clip_collectives):
        assert r["params"] >= 6 and r["all_reduces"] == 1, r


class _OneBlockPlacedTwice(nn.Module):
    """ALBERT-style sharing: one block object placed twice in a ModuleList (or called twice from one attribute)."""

    def __init__(self, placed_twice: bool):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.blocks = nn.ModuleList([block, block] if placed_twice else [block])
        self.head = nn.Linear(8, 10)

    def forward(self, idx):
        x = self.emb(idx)
        for block in (self.blocks if len(self.blocks) == 2 else [self.blocks[0]] * 2):
            x = block(x)
        return self.head(x)


def one_block_placed_twice_case(mode: str, placed_twice: bool) -> float:
    import shardtensor

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    plain = _OneBlockPlacedTwice(placed_twice).double()
    model = shardtensor.shard_module(copy.deepcopy(plain), gather=mode)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [torch.randint(0, 10, (2, 4), generator=gen) for _ in range(world)]
        (sum(plain(x).square().mean() for x in batches) / world).backward()
        model(batches[rank]).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
@pytest.mark.parametrize("placed_twice", [True, False])
def test_one_block_placed_twice_trains_like_the_unsharded_model(mode, placed_twice):
    """``nn.ModuleList([block, block])`` (weights shared before sharding) raised at the first forward that its
    weight "was replaced after shard_module ... tie the weights before shard_module": shard_module visited the
    block twice and sharded its own ShardedParam again (helper 21).  It trains like the unsharded model now."""
    for diff in run_on_ranks(2, one_block_placed_twice_case, mode, placed_twice):
        assert diff < 1e-10, diff


def weight_constraint_case(how: str) -> dict:
    """A max-norm constraint or a pruning mask after each step, in place (refused) or written back whole."""
    import shardtensor
    from shardtensor import ShardedOpError

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    model = shardtensor.shard_module(copy.deepcopy(plain))
    mask = (torch.rand(7, 5, generator=torch.Generator().manual_seed(2)) > 0.3).double()
    constraints = {
        "max-norm": lambda w: w / w.norm(dim=1, keepdim=True).clamp(min=0.5) * 0.5,
        "mask": lambda w: w * mask,
    }
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, model)]
    refused = ""
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = [torch.randn(4, 5, generator=gen, dtype=torch.float64) for _ in range(world)]
        (sum(plain(x).square().mean() for x in xs) / world).backward()
        model(xs[rank]).square().mean().backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            plain[0].weight.copy_(constraints[how](plain[0].weight))
            try:  # the in-place form: refused before it writes
                model[0].weight.mul_(mask) if how == "mask" else model[0].weight.renorm_(2, 0, 0.5)
            except ShardedOpError as exc:
                refused = str(exc)
            model[0].weight.copy_(constraints[how](model[0].weight))  # the route the refusal names
    full = shardtensor.full_state_dict(model)
    return {"refused": refused, "diff": max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())}


@pytest.mark.parametrize("how", ["max-norm", "mask"])
def test_a_weight_constraint_written_back_whole_trains_like_the_unsharded_model(how):
    """A max-norm constraint, ``renorm_`` or a pruning mask applied in place after each step is refused on every
    rank before it writes (it cannot run on this rank's rows alone); the fix its message names, ``w.copy_(...)``
    of the out-of-place result, trains equal to the unsharded model (helper 20)."""
    for out in run_on_ranks(2, weight_constraint_case, how):
        assert "p.copy_(p * mask)" in out["refused"], out
        assert out["diff"] < 1e-12, out
