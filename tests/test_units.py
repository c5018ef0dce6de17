"""Gather units: ranks whose data routes them to different experts still train exactly like the unsharded model.

With the default unit policy an MoE layer (a module with an expert list) or the block holding it gathers all its
parameters at its forward and backward, and reduces its gradients together, so every rank issues the same
collectives whatever its routing; an expert no rank used keeps ``grad=None`` (AdamW leaves it undecayed, as
the unsharded reference does)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rank_pool import run_on_ranks

MODES = ["sequential", "overlapped"]
ROUTES = {"same-counts": ((0, 0, 0, 0), (1, 1, 1, 1)), "different-counts": ((0, 1, 0, 1), (1, 1, 1, 1))}


class MoE(nn.Module):
    """An expert loop that calls only the experts some token was routed to (transformers' eager Mixtral path)."""

    def __init__(self, dim: int, experts: int = 3):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(dim, dim, dtype=torch.float64) for _ in range(experts))

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                out = out.index_put((mask,), expert(x[mask]))
        return out


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim, dtype=torch.float64)
        self.moe = MoE(dim)

    keywords = False  # call the MoE layer with keyword arguments

    def forward(self, x, route):
        h = self.proj(x).tanh()
        return x + (self.moe(x=h, route=route) if self.keywords else self.moe(h, route))


class Net(nn.Module):
    """Blocks in a ModuleList (each a default unit) with an MoE layer inside each, and a head outside any unit."""

    def __init__(self, dim: int = 6, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.head = nn.Linear(dim, 1, dtype=torch.float64)

    def forward(self, x, route):
        for block in self.blocks:
            x = block(x, route)
        return self.head(x).square().mean()


class EmbeddedNet(Net):
    """``Net`` behind an input layer (an embedding's place): the first block's input needs a gradient."""

    def __init__(self, dim: int = 6):
        super().__init__(dim)
        self.embed = nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x, route):
        return super().forward(self.embed(x), route)


class BareMoE(MoE):
    """The MoE layer as the root module: a unit by the expert-list rule."""

    def forward(self, x, route):
        return super().forward(x, route).square().mean()


class DictMoE(nn.Module):
    """Experts in an ``nn.ModuleDict`` (transformers' ``SwitchTransformersExperts``, keyed ``expert_0``...)."""

    def __init__(self, dim: int = 6, experts: int = 3):
        super().__init__()
        self.router = nn.Linear(dim, experts, dtype=torch.float64)
        self.experts = nn.ModuleDict({f"expert_{e}": nn.Linear(dim, dim, dtype=torch.float64)
                                      for e in range(experts)})

    def forward(self, x, route):
        out = self.router(x).softmax(-1)[:, :1] * x
        for e, expert in enumerate(self.experts.values()):
            mask = route == e
            if mask.any():
                out = out.index_put((mask,), expert(x[mask]), accumulate=True)
        return out.square().mean()


class StackedExperts(nn.Module):
    """Experts as slices of one parameter, indexed only for routed tokens (transformers v5's MixtralExperts)."""

    def __init__(self, dim: int = 6, experts: int = 3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, dim, dim, dtype=torch.float64) / dim)

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for e in range(self.weight.shape[0]):
            mask = route == e
            if mask.any():
                out = out.index_put((mask,), x[mask] @ self.weight[e])
        return out.tanh().square().mean()


class DerivedExpert(nn.Module):
    """An expert that computes from its own weights in forward: a Gemma-style gain ``1 + g`` and a rescaled
    weight (autocast's cast of an expert's weight is the same kind of op)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=torch.float64)
        self.g = nn.Parameter(torch.randn(dim, dtype=torch.float64))

    def forward(self, x):
        return self.lin(x) * (1.0 + self.g) + x @ (self.lin.weight * 2.0).T


class DerivedMoE(MoE):
    def __init__(self, dim: int = 6, experts: int = 3):
        super().__init__(dim, experts)
        self.experts = nn.ModuleList(DerivedExpert(dim) for _ in range(experts))

    def forward(self, x, route):
        return super().forward(x, route).square().mean()


def train_and_compare(mode: str, routes: tuple, model_kind: str, units=None) -> dict:
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    reference = {"net": Net, "bare": lambda: BareMoE(6), "stacked": StackedExperts, "dict": DictMoE,
                 "embedded": EmbeddedNet, "derived": DerivedMoE}[model_kind]()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=mode, units=units)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = [torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(world)]
        model(xs[rank], torch.tensor(routes[rank])).backward()
        opt.step()
        opt.zero_grad()
        sum(reference(x, torch.tensor(r)) for x, r in zip(xs, routes)).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return {name: (full[name] - value).abs().max().item() for name, value in reference.state_dict().items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("routes", ROUTES.values(), ids=ROUTES.keys())
@pytest.mark.parametrize("model_kind", ["net", "bare", "stacked", "dict", "derived"])
def test_expert_loop_trains_like_the_unsharded_model(mode, routes, model_kind):
    """``derived`` (helper C): experts computing ``1 + g`` or ``w * 2`` ran that read shard-wise and gathered the
    result on demand, unnamed, so ranks routed to different experts mixed their rows (losses 0.05 vs 0.11),
    silently; autocast's cast of an expert's weight did the same."""
    for rank, diffs in enumerate(run_on_ranks(2, train_and_compare, mode, routes, model_kind, timeout=120)):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-9, f"rank {rank}: {worst} differs by {diffs[worst]:.3g}"


class ExpertGivingItsWeight(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.lin = nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x), self.lin.weight * 2.0


class MoELayerGivingWeights(nn.Module):
    def __init__(self, dim: int = 6, experts: int = 3):
        super().__init__()
        self.experts = nn.ModuleList(ExpertGivingItsWeight(dim) for _ in range(experts))

    def forward(self, x, route):
        out, kept = torch.zeros_like(x), []
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                y, w2 = expert(x[mask])
                out, _ = out.index_put((mask,), y), kept.append(w2)
        return out, kept


class MoEGivingWeights(nn.Module):
    """The MoE layer hands tensors made from its experts' weights out, used after the layer is released."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.moe, self.head = MoELayerGivingWeights(dim), nn.Linear(dim, dim, dtype=torch.float64)

    def forward(self, x, route):
        out, kept = self.moe(x, route)
        for w2 in kept:
            out = out + x @ w2.T
        return self.head(out).square().mean()


def weights_kept_past_the_unit_case(mode: str, routes: tuple):
    """The worst gradient difference from the unsharded model, or the ``DivergenceError`` a rank raised."""
    import shardtensor

    torch.manual_seed(0)
    reference = MoEGivingWeights()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=mode)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    xs = [torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    try:
        model(xs[rank], torch.tensor(routes[rank])).backward()
    except shardtensor.DivergenceError as exc:
        return str(exc)
    sum(reference(x, torch.tensor(r)) for x, r in zip(xs, routes)).div(world).backward()
    grads = dict(model.named_parameters())
    return max((grads[n].grad.full_tensor() - p.grad).abs().max().item()
               for n, p in reference.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("mode", MODES)
def test_a_tensor_derived_from_an_expert_weight_kept_past_the_moe_layer(mode):
    """Inside the MoE layer a read of an expert's weight is a shard with its recipe (see recipes.py); used after
    the layer released its weights, it was gathered on demand by its shard, so ranks that kept different
    experts' tensors mixed their rows (0.51 off, silently).  Now it is made by its recipe from the expert's
    weight, gathered by name: right where every rank kept the same expert's, named where not."""
    for diff in run_on_ranks(2, weights_kept_past_the_unit_case, mode, ((0, 0, 0, 0), (0, 0, 0, 0))):
        assert isinstance(diff, float) and diff < 1e-12, diff
    for message in run_on_ranks(2, weights_kept_past_the_unit_case, mode, ((0, 0, 0, 0), (2, 2, 2, 2))):
        assert isinstance(message, str) and "moe.experts.0.lin.weight" in message and "moe.experts.2.lin.weight" in message, \
            message


def no_expert_case(mode: str, routes: tuple, keywords: bool = False) -> dict:
    """``train_and_compare`` on the embedded net, or the ``DivergenceError`` a rank raised."""
    import shardtensor

    Block.keywords = keywords
    try:
        return {"diffs": train_and_compare(mode, routes, "embedded")}
    except shardtensor.DivergenceError as exc:
        return {"error": str(exc)}
    finally:
        Block.keywords = False  # (a pooled rank process runs other tests next)


@pytest.mark.parametrize("mode,keywords", [(m, False) for m in MODES] + [("sequential", True)])
def test_a_rank_whose_tokens_reach_no_expert(mode, keywords):
    # Every token of rank 1 dropped (capacity, or an empty batch): its MoE output is zeros_like(x), which needs no
    # gradient.  Overlapped mode (the block, with its residual, is the unit) trains like the unsharded model, and
    # so does sequential mode (the MoE layer is the unit), where it was a DivergenceError: that rank never began
    # the unit's backward; it asks the others now and ties its output to its inputs (see [Note: a unit's output
    # that needs no gradient on one rank]).
    # Its input passed as a keyword (moe(x=h, route=route)) is tied too.
    for rank, out in enumerate(run_on_ranks(2, no_expert_case, mode, [(0, 1, 2, 0), (-1, -1, -1, -1)], keywords,
                                            timeout=120)):
        assert "diffs" in out, (rank, out)
        worst = max(out["diffs"], key=out["diffs"].get)
        assert out["diffs"][worst] < 1e-9, f"rank {rank}: {worst} differs by {out['diffs'][worst]:.3g}"


@pytest.mark.parametrize("mode", MODES)
def test_no_rank_reaching_any_expert_trains_like_the_unsharded_model(mode):
    # Every rank's tokens dropped: the layers before the MoE get no gradient (None, so AdamW does not decay
    # them), as unsharded.  A change that tied the MoE output to its inputs gave them zero gradients (1.2e-3 off).
    for rank, out in enumerate(run_on_ranks(2, no_expert_case, mode, [(-1, -1, -1, -1)] * 2, timeout=120)):
        worst = max(out["diffs"], key=out["diffs"].get)
        assert out["diffs"][worst] < 1e-12, f"rank {rank}: {worst} differs by {out['diffs'][worst]:.3g}"


def unit_collectives(units, mode: str = "overlapped") -> dict:
    """Unit gathers and gradient reductions count; an expert nobody used keeps grad None on every rank."""
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    model = shardtensor.shard_module(Net(), gather=mode, units=units)
    x = torch.randn(4, 6, dtype=torch.float64)
    route = torch.tensor([0, 1, 0, 1] if dist.get_rank() == 0 else [1, 1, 1, 1])
    model(x, route).backward()
    return {"unused_grad_is_none": model.blocks[0].moe.experts[2].weight.grad is None,
            "used_grad": model.blocks[0].moe.experts[0].weight.grad is not None,
            "units": [u.name for u in model._shardtensor.grad_sync.units.units]
            if model._shardtensor.grad_sync.units is not None else []}


def test_default_units_are_the_blocks_and_unused_experts_keep_no_gradient():
    # The blocks, then the root for what no block holds (the head), as FSDP2's fully_shard(model) after its blocks.
    for out in run_on_ranks(2, unit_collectives, None):
        assert out == {"unused_grad_is_none": True, "used_grad": True, "units": ["blocks.0", "blocks.1", "Net"]}


def test_sequential_mode_defaults_to_the_data_dependent_units_only():
    # Its point is the lowest peak (one parameter at a time): whole blocks would raise it; only the MoE layers,
    # whose members the data picks, need a unit for the right numbers.
    for out in run_on_ranks(2, unit_collectives, None, "sequential"):
        assert out == {"unused_grad_is_none": True, "used_grad": True, "units": ["blocks.0.moe", "blocks.1.moe"]}


def test_the_root_is_a_unit_only_where_what_the_blocks_leave_fits_in_one_block():
    """The root unit is held through the forward: where the blocks are a small part of the model (a container of
    two layers beside attention and a large embedding) it would hold nearly the whole model, so it is left out."""
    from shardtensor._unit_policy import default_units
    from shardtensor.models import GPT, GPTConfig

    gpt = GPT(GPTConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=2, block_size=8))
    assert default_units(gpt) == [*gpt.blocks, gpt]
    assert default_units(gpt, blocks=False) == []  # sequential mode: no blocks, no root
    small_blocks = nn.ModuleDict({"emb": nn.Embedding(400, 16), "ff": nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))})
    assert default_units(small_blocks) == list(small_blocks["ff"])


def test_units_can_be_chosen_by_class_or_callable():
    assert run_on_ranks(2, unit_collectives, (MoE,))[0]["units"] == ["blocks.0.moe", "blocks.1.moe"]
    assert run_on_ranks(2, unit_collectives, _is_block)[0]["units"] == ["blocks.0", "blocks.1"]


def _is_block(module) -> bool:
    return type(module).__name__ == "Block"


def collectives_per_step(layers: int) -> int:
    """Collectives one training step issues in overlapped mode (each is preceded by one identity check)."""
    import shardtensor
    from shardtensor.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=layers, n_head=2,
                                                   n_embd=16)), gather="overlapped")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (2, 8))
    counts = []
    for _ in range(3):  # the first step records the order; the later ones replay it
        before = shardtensor.identity_check_stats()["checks"]
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        counts.append(shardtensor.identity_check_stats()["checks"] - before)
    return counts[-1]


def test_a_block_costs_at_most_two_collectives_per_direction():
    """Gather units coalesce a block's 12 parameters: one gather in forward, one before its backward and one
    reduce-scatter of its gradients, whatever the parameter count (per-parameter collectives cost 36 a block)."""
    four, eight = (run_on_ranks(2, collectives_per_step, layers)[0] for layers in (4, 8))
    assert eight - four <= 4 * 2 * 2, (four, eight)
    assert four > 0


# ------------------------------------------------------------------ writes into held parameters
class ConstrainedBlock(nn.Module):
    """A weight constraint applied in forward (a max-norm or a clamp, as some GAN and RL code does), and a write
    into the next block's weight: each lands in shards a unit gathered before the write.  Each write is idempotent,
    so the reference may run one forward per rank's batch."""

    def __init__(self, write: str):
        super().__init__()
        self.lin, self.write, self.next = nn.Linear(6, 6, dtype=torch.float64), write, None

    def forward(self, x):
        with torch.no_grad():
            if self.write == "max_norm":
                self.lin.weight.mul_(min(1.0, 1.5 / float(self.lin.weight.norm())))
            elif self.write == "clamp":
                self.lin.weight.clamp_(-0.3, 0.3)
            elif self.write == "own_row":
                self.lin.weight[2].zero_()
            elif self.write == "next_block" and self.next is not None:
                self.next.lin.weight.clamp_(-0.2, 0.2)
        return torch.tanh(self.lin(x))


def writes_in_forward_case(mode: str, write: str) -> dict:
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    reference = nn.Sequential(*[ConstrainedBlock(write) for _ in range(3)])
    for block, after in zip(reference, reference[1:]):
        object.__setattr__(block, "next", after)  # a reference, not a child module (deepcopy maps it too)
    model = copy.deepcopy(reference)
    shardtensor.shard_module(model, gather=mode)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for _ in range(3):
        xs = [torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(world)]
        out = model(xs[rank])
        want = reference(xs[rank]).detach()
        outputs.append((out.detach() - want).abs().max().item())
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        for x in xs:  # one graph each: the next forward's write would change what this one saved
            reference(x).square().mean().div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return {"outputs": max(outputs), "params": max((full[k] - v).abs().max().item()
                                                   for k, v in reference.state_dict().items())}


@pytest.mark.parametrize("mode", ["overlapped", "auto", "sequential"])
@pytest.mark.parametrize("write", ["max_norm", "clamp", "own_row", "next_block"])
def test_a_write_into_a_gathered_parameter_during_forward_is_seen_by_the_ops_after_it(mode, write):
    for rank, diffs in enumerate(run_on_ranks(2, writes_in_forward_case, mode, write, timeout=120)):
        assert diffs["outputs"] < 1e-12 and diffs["params"] < 1e-9, (rank, diffs)


# ------------------------------------------------------------- replicated parameters on data-dependent paths
class GainedExpert(nn.Module):
    """An expert with a 0-d gain (ReZero style): always replicated, whatever ``persist_numel``."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d, dtype=torch.float64)
        self.gain = nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

    def forward(self, x):
        return self.gain * self.lin(x)


class GainedMoE(nn.Module):
    def __init__(self, d: int = 6, experts: int = 4):
        super().__init__()
        self.experts = nn.ModuleList(GainedExpert(d) for _ in range(experts))
        self.head_a, self.head_b = nn.Linear(d, 1, dtype=torch.float64), nn.Linear(d, 1, dtype=torch.float64)

    def forward(self, x, experts, head):  # the experts in the order this rank's router listed them
        for e in experts:
            x = x + self.experts[e](x)
        return (self.head_a if head == 0 else self.head_b)(x).square().mean()


def replicated_paths_case(mode: str, persist_numel: int) -> dict:
    """Replicated parameters (0-d gains; with ``persist_numel``, the biases and heads too) that each rank's data
    reaches in another set and order: experts (2, 0) on even ranks, (0, 1) on odd ones (expert 3 on none), head
    a or head b by rank."""
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    reference = GainedMoE()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=mode, persist_numel=persist_numel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    routes = [((2, 0), 0) if r % 2 == 0 else ((0, 1), 1) for r in range(world)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        xs = [torch.randn(4, 6, dtype=torch.float64, generator=gen) for _ in range(world)]
        model(xs[rank], *routes[rank]).backward()
        unused_grads = [model.experts[3].gain.grad, model.experts[3].lin.bias.grad]
        opt.step()
        opt.zero_grad()
        sum(reference(x, *r) for x, r in zip(xs, routes)).div(world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return {"diffs": {k: (full[k] - v).abs().max().item() for k, v in reference.state_dict().items()},
            "unused_grads": [g is None for g in unused_grads]}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("persist_numel", [0, 50])
def test_replicated_parameters_reached_differently_per_rank_train_like_the_unsharded_model(world, mode,
                                                                                           persist_numel):
    # Replicated gradients were averaged in the order their hooks fired (one flat all-reduce at the end of
    # backward, or one per parameter in sequential mode): rank 0's expert-2 gain was averaged with rank 1's
    # expert-1 gain, silently (0.1 off).  Now every replicated parameter, in registration order, with a
    # has-gradient count.
    for rank, result in enumerate(run_on_ranks(world, replicated_paths_case, mode, persist_numel, timeout=180)):
        diffs = result["diffs"]
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-9, f"rank {rank}: {worst} differs by {diffs[worst]:.3g}"
        assert result["unused_grads"] == [True, True], (rank, result)  # no rank reached expert 3


class _FailsWhenArmed(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if _FailsWhenArmed.armed:
            raise RuntimeError("a backward that fails midway")
        return grad


class _TwoGains(nn.Module):
    """A layer and two 0-d gains (replicated), one of which each batch picks (``_FailsWhenArmed`` between)."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.lin = nn.Linear(dim_in, dim_out, dtype=torch.float64)
        self.a = nn.Parameter(torch.tensor(1.1, dtype=torch.float64))
        self.b = nn.Parameter(torch.tensor(0.8, dtype=torch.float64))

    def forward(self, x, head):
        return (_FailsWhenArmed.apply(self.lin(x)) * (self.a if head == 0 else self.b)).square().mean()


def _two_gains_pair(dim_in: int, dim_out: int, mode: str) -> tuple:
    """(rank, world, the unsharded ``_TwoGains``, its sharded copy, an SGD for each)."""
    import torch.distributed as dist

    import shardtensor

    torch.manual_seed(0)
    reference = _TwoGains(dim_in, dim_out)
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=mode)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    return dist.get_rank(), dist.get_world_size(), reference, model, opts


def failed_backward_case(mode: str) -> dict:
    """A second micro-batch whose backward raises after a replicated parameter's hook fired, ``zero_grad()``, then
    two steps in which the ranks' data pick different 0-d gains."""
    import shardtensor

    rank, world, reference, model, opts = _two_gains_pair(6, 8, mode)
    for step in range(3):
        xs = [torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + r))
              for r in range(world)]
        heads = [0 if step == 0 else r % 2 for r in range(world)]
        for micro in range(2 if step == 0 else 1):  # step 0: the second micro-batch's backward fails
            _FailsWhenArmed.armed = step == 0 and micro == 1
            for loss in (model(xs[rank], heads[rank]), sum(reference(x, h) for x, h in zip(xs, heads)) / world):
                try:
                    loss.backward()
                except RuntimeError:
                    assert _FailsWhenArmed.armed
        _FailsWhenArmed.armed = False
        for opt in opts:
            if step:
                opt.step()
            opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return {k: (full[k] - v).abs().max().item() for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_backward_leaves_no_replicated_gradient_behind(mode):
    # The failed backward's replicated gradients were still listed at the next forward, with .grad None since
    # zero_grad(): AttributeError on every later step.
    for rank, diffs in enumerate(run_on_ranks(2, failed_backward_case, mode, timeout=120)):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-10, f"rank {rank}: {worst} differs by {diffs[worst]:.3g}"


def accumulated_gains_case(mode: str, no_sync: bool) -> dict:
    """Two steps of three micro-batches (the first two inside ``gradient_sync(model, False)`` when ``no_sync``); each
    rank's data picks its own 0-d gain, another one in each micro-batch.  Largest difference from the unsharded
    run of every rank's batch."""
    import contextlib

    import shardtensor

    rank, world, reference, model, opts = _two_gains_pair(4, 4, mode)
    for step in range(2):
        for micro in range(3):
            xs = [torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + 10 * micro
                                                                                                   + r))
                  for r in range(world)]
            heads = [(r + micro + step) % 2 for r in range(world)]
            deferred = no_sync and micro < 2
            with shardtensor.gradient_sync(model, False) if deferred else contextlib.nullcontext():
                model(xs[rank], heads[rank]).backward()
            (sum(reference(x, h) for x, h in zip(xs, heads)) / world).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return {k: (full[k] - v).abs().max().item() for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("no_sync", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_replicated_parameters_picked_per_rank_in_later_micro_batches_train_like_the_unsharded_model(
        mode, no_sync, world):
    # A later micro-batch's replicated gradients were averaged as their hooks fired, each under its own name: the
    # ranks ran different collectives (DivergenceError), and deferred ones (gradient_sync off) that the synced
    # backward did not reach were averaged one by one in an order the data decided.
    for rank, diffs in enumerate(run_on_ranks(world, accumulated_gains_case, mode, no_sync, timeout=120)):
        worst = max(diffs, key=diffs.get)
        assert diffs[worst] < 1e-10, f"rank {rank}: {worst} differs by {diffs[worst]:.3g}"


def hooked_gains_case() -> dict:
    """A user hook on both 0-d gains (it reads their gradients during backward); each rank's data picks its own."""
    import torch.distributed as dist

    import shardtensor

    shardtensor.set_collective_timeout(30)
    model = shardtensor.shard_module(_TwoGains(4, 4), gather="sequential")
    for gain in (model.a, model.b):
        gain.register_hook(lambda g: g.clamp(-1, 1))
    try:
        model(torch.randn(3, 4, dtype=torch.float64), dist.get_rank() % 2).backward()
    except shardtensor.DivergenceError as exc:
        return {"error": str(exc)}
    return {"error": None}


def test_replicated_parameters_a_hook_reads_picked_per_rank_are_named_with_their_fix():
    # Averaged at once (the hook reads the mean), each under its own name; the message suggested one micro-batch
    # per step (no help) before later micro-batches were averaged at the end of backward.
    for out in run_on_ranks(2, hooked_gains_case, timeout=120):
        assert out["error"] and "remove the hook" in out["error"], out


class _GainNet(nn.Module):
    """A layer used only by some micro-batches, and 0-d gains (replicated) each rank's data picks or skips."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 8)
        self.gains = nn.ParameterList([nn.Parameter(torch.tensor(1.0 + i)) for i in range(2)])

    def forward(self, x, use_b: bool, gain):
        h = self.a(x)
        h = self.b(h) if use_b else h
        return (h if gain is None else h * self.gains[gain]).square().mean()


def _gain_route(rank: int, micro: int):
    """Micro-batch 0 (unsynced) uses ``b``, micro-batch 1 (synced) does not; in micro-batch 1 rank 1 uses no
    gain, so its synced backward's first hook is a sharded weight's, its peer's a gain's."""
    return micro == 0, (None if (micro == 1 and rank == 1) else rank % 2)


def deferred_layer_beside_per_rank_gains_case(mode: str) -> float:
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

    def batch(step, micro, r):
        return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(100 * step + 10 * micro + r))

    torch.manual_seed(0)
    plain = _GainNet().double()
    torch.manual_seed(0)
    import shardtensor

    model = shardtensor.shard_module(_GainNet().double(), gather=mode)
    for net, sharded in ((plain, False), (model, True)):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for step in range(2):
            for micro in range(2):
                for r in ([rank] if sharded else range(world)):
                    loss = net(batch(step, micro, r), *_gain_route(r, micro)) / (2 * (1 if sharded else world))
                    if sharded and micro == 0:
                        with shardtensor.gradient_sync(net, False):
                            loss.backward()
                    else:
                        loss.backward()
            opt.step()
            opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    return max((full[k] - v).abs().max().item() for k, v in plain.state_dict().items())


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
def test_a_layer_only_unsynced_micro_batches_use_beside_per_rank_gains_trains_like_the_unsharded_model(mode):
    """The deferred weight's reduction and the gains' average were two end-of-backward callbacks queued by
    whichever hook fired first: in a data-chosen order, a DivergenceError (last note's R3)."""
    for diff in run_on_ranks(2, deferred_layer_beside_per_rank_gains_case, mode):
        assert diff < 1e-12, diff


def no_sync_reductions_case(mode: str) -> dict:
    """Reductions issued during ``gradient_sync(model, False)`` micro-batches, and the gradients after the synced
    one against the unsharded model's."""
    import shardtensor
    from shardtensor import _comm, _comm_rows

    counted = {"reductions": 0}

    def counting(fn):
        def run(*args, **kwargs):
            counted["reductions"] += 1
            return fn(*args, **kwargs)
        return run

    _comm_rows.reduce_scatter_in_place = counting(_comm_rows.reduce_scatter_in_place)
    _comm.reduce_scatter_rows = counting(_comm.reduce_scatter_rows)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    model = shardtensor.shard_module(copy.deepcopy(plain), gather=mode)
    xs = [[torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * m + r))
           for r in range(world)] for m in range(3)]
    with shardtensor.gradient_sync(model, False):
        for m in range(2):
            model(xs[m][rank]).square().mean().backward()
    out = {"while_off": counted["reductions"]}
    model(xs[2][rank]).square().mean().backward()
    out["after"] = counted["reductions"]
    for m in range(3):
        for r in range(world):
            (plain(xs[m][r]).square().mean() / world).backward()
    grads = dict(model.named_parameters())
    out["off"] = max((grads[n].grad.full_tensor() - p.grad).abs().max().item() for n, p in plain.named_parameters())
    return out


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
def test_micro_batches_under_gradient_sync_off_reduce_nothing(mode):
    """A gather unit reduce-scattered zeros after each of them (every gradient was kept whole by GradSync)."""
    for out in run_on_ranks(2, no_sync_reductions_case, mode):
        assert out["while_off"] == 0 and out["after"] > 0 and out["off"] < 1e-12, out


def sends_kept_after_a_step_case() -> int:
    """The reduce-scatter by sends keeps each send and receive referenced until it completes: once waited for,
    none may stay (they hold the gradient buffers and the scratch: +20 MiB of peak on the benchmark GPT)."""
    import shardtensor
    from shardtensor import _comm_rows

    torch.manual_seed(0)
    earlier = {id(w) for w in _comm_rows._IN_FLIGHT}  # a receive orphaned by an earlier test's failed backward
    model = shardtensor.shard_module(nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4)))
    model(torch.randn(3, 256)).square().mean().backward()
    return len([w for w in _comm_rows._IN_FLIGHT if id(w) not in earlier])


def test_no_send_of_a_finished_reduction_is_kept_past_the_backward():
    assert run_on_ranks(2, sends_kept_after_a_step_case) == [0, 0]


def frozen_on_one_rank_case(mode: str, when: str, which: str = "weight") -> str:
    """``requires_grad_(False)`` on rank 1 only, before or after ``shard_module``: three SGD steps."""
    import torch.distributed as dist

    import shardtensor
    from shardtensor import DivergenceError

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 2)))
    frozen = getattr(model[0][0], which)  # the bias is kept whole (below persist_numel)
    if when == "before" and rank == 1:
        frozen.requires_grad_(False)
    model = shardtensor.shard_module(model, gather=mode, persist_numel=7)
    if when == "after" and rank == 1:
        getattr(model[0][0], which).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for s in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * s + rank))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except DivergenceError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("when,which", [("before", "weight"), ("after", "weight"), ("after", "bias")])
def test_a_parameter_frozen_on_one_rank_only_is_named_on_every_rank(mode, when, which):
    """Helper E: in overlapped mode the unit's has-gradient flags took the frozen rank's missing gradient for an
    expert its tokens skipped: every row moved by rank 0's gradient halved (0.02-0.05 off DDP), silently.  A
    kept-whole parameter (the bias here) had the same flags in the replicated gradients' all-reduce."""
    for message in run_on_ranks(2, frozen_on_one_rank_case, mode, when, which, timeout=120):
        assert "ranks diverged" in message, message
        if mode == "overlapped" or which == "bias":
            assert f"frozen: 1, first '0.0.{which}'" in message and "requires_grad must be the same" in message, message


class _ExpertLoop(nn.Module):
    """Calls only the experts the (given) routing reaches: a gather unit by default (it holds an expert list)."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(dim, dim) for _ in range(experts)])

    def forward(self, h: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().squeeze(-1)
            if idx.numel():
                out = out.index_add(0, idx, expert(h[idx]))
        return out


class _RoutedExperts(nn.Module):
    def __init__(self, dim: int = 4, experts: int = 3):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = _ExpertLoop(dim, experts)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.moe(self.inp(x), route)


def accumulated_routing_case(gather: str, routes: list) -> float:
    """Two micro-batches per step, the first under gradient_sync(model, False); ``routes[rank][m]``: the experts
    micro-batch m reaches on that rank.  The largest gradient difference from the unsharded model."""
    import copy

    import shardtensor

    torch.manual_seed(0)
    reference = _RoutedExperts().double()
    model = shardtensor.shard_module(copy.deepcopy(reference), gather=gather)
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(1)
    xs = [[torch.randn(4, 4, generator=gen, dtype=torch.float64) for _ in range(2)] for _ in range(world)]
    route = lambda r, m: torch.tensor([int(routes[r][m][i % len(routes[r][m])]) if routes[r][m] != "-" else -1  # noqa: E731
                                       for i in range(4)])
    for m in range(2):
        sum(reference(xs[r][m], route(r, m)).pow(2).mean() for r in range(world)).div(2 * world).backward()
    with shardtensor.gradient_sync(model, False):
        model(xs[rank][0], route(rank, 0)).pow(2).mean().div(2).backward()
    model(xs[rank][1], route(rank, 1)).pow(2).mean().div(2).backward()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            worst = max(worst, (p.grad.full_tensor() - q.grad).abs().max().item())
    return worst


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
@pytest.mark.parametrize("routes", [[["0", "1"], ["1", "0"]], [["01", "2"], ["-", "0"]]])
def test_experts_reached_in_a_deferred_micro_batch_only_are_reduced_with_their_unit(gather, routes):
    # Each rank's experts that only the no-sync micro-batch reached were reduced apart at the synced backward's
    # end, each rank its own: a DivergenceError on every MoE step with gradient accumulation.
    assert max(run_on_ranks(2, accumulated_routing_case, gather, routes)) < 1e-12
