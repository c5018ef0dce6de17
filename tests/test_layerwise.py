"""Layer-wise placement: whole parameters owned by one rank.

- Training with ``placement="layerwise"`` equals single-process training on the concatenated batch (stock AdamW,
  for-loop / foreach / fused, with clipping), and ``shardtensor.optim.Muon`` on layer-wise shards equals the
  same Muon run unsharded (stock ``torch.optim.Muon`` + ``torch.optim.AdamW`` on a deepcopy), on 2 and 4 ranks.
- The plan is balanced: no rank owns more than the largest parameter above the mean.

Tolerance: the runs are in float64 and compared within 1e-5 (the acceptance bound); they land ~1e-14 apart.
float64 matters for Muon: ``torch.optim.Muon`` orthogonalises in bfloat16, so two float32 runs whose mean
gradients differ in the last bit (a reduce sums in another order than autograd does) can round an update element
to neighbouring bfloat16 values.  In float64 the inputs to that cast agree to ~1e-16 and round alike.
AdamW's eps is 1e-8, as in tests/test_parity.py (see the note there on eps and rounding noise).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rank_pool import run_on_ranks


class _Net(nn.Module):
    """Embedding tied to the head, nn.MultiheadAttention (its packed in_proj weight is split: views), LayerNorm,
    a 1-row weight, and a 0-d parameter (replicated, not placed)."""

    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.ln = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))
        self.gate = nn.Linear(dim, 1)  # a 1-row weight
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        a, _ = self.attn(x, x, x, need_weights=False)
        x = self.ln(x + a)
        x = x + self.ff(x) * torch.sigmoid(self.gate(x))
        return self.head(x) / self.temperature


def _build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Net().double()


def _micro_batches(gen: torch.Generator, world: int):
    return [(torch.randint(0, 11, (2, 5), generator=gen), torch.randint(0, 11, (2, 5), generator=gen))
            for _ in range(world)]


def _loss(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), target.flatten())


def _muon_reference(model: nn.Module, lr: float, adamw_lr: float):
    """The recipe written out with stock optimizers: Muon for 2-d non-embedding weights, AdamW for the rest."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon = [p for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if not (p.dim() == 2 and id(p) not in embeddings)]
    return [torch.optim.Muon(muon, lr=lr), torch.optim.AdamW(rest, lr=adamw_lr, betas=(0.9, 0.95), eps=1e-8,
                                                            weight_decay=0.0)]


def muon_unfreeze_case(frozen_at_build: bool) -> dict:
    """Layer-wise Muon built while ``ff`` is frozen (staged fine-tuning), unfrozen before the first step."""
    import shardtensor
    from shardtensor import _comm
    from shardtensor.optim import Muon

    model = shardtensor.shard_module(_build(3), placement="layerwise")
    model.ff.requires_grad_(not frozen_at_build)
    opt = Muon(model, lr=0.02, adamw_lr=0.02)
    model.ff.requires_grad_(True)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        idx, target = _micro_batches(gen, _comm.world_size())[_comm.rank()]
        _loss(model, idx, target).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}


def test_muon_steps_a_layer_frozen_when_it_was_built_once_it_is_unfrozen():
    # As torch's optimizers do.  It never stepped it, and never cleared its gradient: the gradient grew each step,
    # and inflated any global clipping norm.
    for built_frozen, built_unfrozen in zip(run_on_ranks(2, muon_unfreeze_case, True),
                                           run_on_ranks(2, muon_unfreeze_case, False)):
        for key, value in built_unfrozen.items():
            assert torch.equal(built_frozen[key], value), key


# ---------------------------------------------------------------------------------------------- per rank
def train_layerwise(case: dict) -> dict:
    """Runs on every rank: layer-wise training vs the unsharded reference; the max parameter difference."""
    import shardtensor
    from shardtensor import _comm
    from shardtensor.layerwise import OwnerLayout
    from shardtensor.optim import Muon

    world, rank = _comm.world_size(), _comm.rank()
    model = _build(case["seed"])
    reference = copy.deepcopy(model)
    shardtensor.shard_module(model, placement="layerwise", gather=case["gather"])
    if case["opt"] == "muon":
        opt = Muon(model, lr=case["lr"], adamw_lr=case["lr"])
        ref_opts = _muon_reference(reference, case["lr"], case["lr"])
    else:
        flags = {"forloop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[case["impl"]]
        opt = torch.optim.AdamW(model.parameters(), lr=case["lr"], eps=1e-8, weight_decay=0.1, **flags)
        ref_opts = [torch.optim.AdamW(reference.parameters(), lr=case["lr"], eps=1e-8, weight_decay=0.1, **flags)]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    grad_rows_ok = True
    accum = case.get("accum", 1)  # micro-batches per rank per step: gradients accumulate on the owner
    for step in range(3):
        micro = _micro_batches(gen, world * accum)
        for idx, target in micro[rank * accum : (rank + 1) * accum]:
            (_loss(model, idx, target) / accum).backward()
        (sum(_loss(reference, *m) for m in micro) / len(micro)).backward()
        if step == 0:  # gradients reduced to the owner: whole there, 0 rows elsewhere
            for p in model.parameters():
                if isinstance(p._layout if isinstance(p, shardtensor.ShardedParam) else None, OwnerLayout):
                    expected = p.shape[0] if p._layout.owner == rank else 0
                    grad_rows_ok &= p.grad.to_local().shape[0] == expected
        if case["clip"]:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), case["clip"])
            assert abs(norm.item() - ref_norm.item()) <= 1e-10 * max(1.0, ref_norm.item()), (norm, ref_norm)
        opt.step()
        opt.zero_grad()
        for ref_opt in ref_opts:
            ref_opt.step()
            ref_opt.zero_grad()
    full = shardtensor.full_state_dict(model)
    expected = reference.state_dict()
    assert full.keys() == expected.keys()
    worst = max((full[k] - v).abs().max().item() for k, v in expected.items())
    moved = max((v - _build(case["seed"]).state_dict()[k]).abs().max().item() for k, v in expected.items())
    stats = shardtensor.gather_stats(model)
    muon_owned = len(opt.muon.param_groups[0]["params"]) if case["opt"] == "muon" and opt.muon else 0
    return {"worst": worst, "moved": moved, "grad_rows_ok": grad_rows_ok, "stats": stats, "muon_owned": muon_owned,
            "plan": shardtensor.placement_plan(model)}


def _check(case: dict) -> list[dict]:
    results = run_on_ranks(case["world"], train_layerwise, case)
    for r in results:
        assert r["worst"] <= 1e-5, f"max |layerwise - unsharded| = {r['worst']:.3g} for {case}"
        assert r["moved"] > 1e-3, "training did not move the parameters: the comparison proves nothing"
        assert r["grad_rows_ok"], "a gradient was not whole on its owner / empty elsewhere"
        assert r["plan"] == results[0]["plan"], "ranks computed different plans"
    assert set(results[0]["plan"].values()) == set(range(case["world"])), results[0]["plan"]
    return results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("impl,gather", [("forloop", "sequential"), ("foreach", "overlapped"), ("fused", "overlapped")])
def test_layerwise_adamw_equals_single_process(world, impl, gather):
    results = _check({"seed": 3, "world": world, "gather": gather, "opt": "adamw", "impl": impl, "lr": 1e-2,
                      "clip": 0.5, "accum": 2 if impl == "forloop" else 1})
    if gather == "overlapped":  # broadcasts were prefetched asynchronously, and used
        assert all(r["stats"]["prefetch_hits"] > 0 and r["stats"]["mismatches"] == 0 for r in results), results
    else:
        assert all(r["stats"]["max_alive"] == 1 for r in results), results


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("gather", ["sequential", "overlapped"])
def test_muon_on_layerwise_shards_equals_unsharded_muon(world, gather):
    results = _check({"seed": 5, "world": world, "gather": gather, "opt": "muon", "impl": None, "lr": 2e-2,
                      "clip": None})
    # Each Muon matrix is stepped by exactly one rank (state lives only on owners): ff.0, ff.2, gate, in_proj,
    # out_proj weights.
    assert sum(r["muon_owned"] for r in results) == 5, [r["muon_owned"] for r in results]


# ---------------------------------------------------------------------------------------------- the plan
@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 10**7), min_size=1, max_size=40), st.integers(1, 8))
def test_plan_is_balanced(sizes, world):
    from shardtensor.layerwise import plan_placement

    owners = plan_placement(sizes, world)
    assert owners == plan_placement(list(sizes), world), "the plan must be deterministic"
    assert all(0 <= o < world for o in owners)
    load = [0] * world
    for size, owner in zip(sizes, owners):
        load[owner] += size
    mean = sum(sizes) / world
    assert max(load) <= mean + max(sizes), (load, mean, max(sizes))
    if sum(s > 0 for s in sizes) >= world:
        assert min(load) > 0, f"a rank owns nothing although there are enough parameters: {load}"


def test_plan_keeps_tied_parameters_one_parameter():
    from shardtensor.layerwise import _placed_parameters

    names = [n for n, _ in _placed_parameters(_Net())]
    assert "emb.weight" in names and "head.weight" not in names
    assert "temperature" not in names  # 0-d: replicated


def test_owner_layout_rows():
    from shardtensor.layerwise import OwnerLayout

    shape = torch.Size((5, 3))
    owner = OwnerLayout(shape, 5, rank=1, world=3, group=None, owner=1)
    other = OwnerLayout(shape, 0, rank=2, world=3, group=None, owner=1)
    assert (owner.local_shape(), owner.valid_rows, owner.row_start) == (shape, 5, 0)
    assert (other.local_shape(), other.valid_rows, other.row_start) == (torch.Size((0, 3)), 0, 0)
    full = torch.arange(15.0).reshape(5, 3)
    assert torch.equal(owner.shard_of(full), full) and owner.shard_of(full).data_ptr() != full.data_ptr()
    assert other.shard_of(full).shape == (0, 3)
    assert owner.gather_numel() == 15 and owner != other


# ---------------------------------------------------------------------------------------------- misuse
def test_misuse_is_named():
    import shardtensor
    from shardtensor.optim import CompressedReducer, Muon

    with pytest.raises(ValueError, match="placement='layerwise'"):
        Muon(shardtensor.shard_module(_build(0)))  # dim-0 shards cannot be orthogonalised
    with pytest.raises(ValueError, match="placement='rows'"):
        shardtensor.shard_module(_build(0), placement="rows")
    with pytest.raises(NotImplementedError, match="CompressedReducer"):
        shardtensor.shard_module(_build(0), placement="layerwise", reducer=CompressedReducer())
    with pytest.raises(ValueError, match="2-d"):
        Muon(_build(0), use_muon=lambda name, p: True)


def muon_file_case(source: str) -> dict:
    """Each rank saves ``Muon.state_dict()`` to a file of its own; a fresh run loads its own file, or rank 0's on
    every rank (two layers of one shape: rank 1 owns tensors shaped like rank 0's, so nothing failed)."""
    import io

    import torch.distributed as dist

    import shardtensor
    from shardtensor.optim import Muon

    rank, world = dist.get_rank(), dist.get_world_size()

    def build():
        torch.manual_seed(0)
        model = shardtensor.shard_module(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)),
                                         placement="layerwise")
        return model, Muon(model, lr=0.02, adamw_lr=1e-2)

    def step(model, opt, s):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * s + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for s in range(2):
        step(model, opt, s)
    weights = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    files = [None] * world
    dist.all_gather_object(files, buffer.getvalue())
    step(model, opt, 2)
    want = shardtensor.full_state_dict(model)
    model, opt = build()
    model.load_state_dict(weights)
    before = io.BytesIO()
    torch.save(opt.state_dict(), before)
    try:
        opt.load_state_dict(torch.load(io.BytesIO(files[rank if source == "own" else 0]), weights_only=True))
    except ValueError as exc:
        after = io.BytesIO()
        torch.save(opt.state_dict(), after)
        return {"error": str(exc), "unchanged": before.getvalue() == after.getvalue()}
    step(model, opt, 2)
    return {"error": None, "equal": all(torch.equal(v, want[k]) for k, v in shardtensor.full_state_dict(model).items())}


def test_muon_state_of_another_rank_is_refused_on_every_rank():
    for out in run_on_ranks(2, muon_file_case, "own"):
        assert out == {"error": None, "equal": True}, out
    refused = run_on_ranks(2, muon_file_case, "rank0")
    assert "rank 0's of a 2-rank run" in refused[1]["error"] and "Nothing was loaded" in refused[1]["error"], refused
    assert "another rank's state is not its own" in refused[0]["error"], refused
    assert all(r["unchanged"] for r in refused), refused


def layerwise_checkpoint_case(path: str, saved_as: str, loaded_as: str) -> dict:
    """``save_checkpoint`` of a model placed ``saved_as``, ``load_checkpoint`` into a fresh one (another seed)
    placed ``loaded_as``: the loaded weights against the saved ones."""
    import shardtensor

    def build(seed: int, placement: str):
        return shardtensor.shard_module(_build(seed), **({"placement": "layerwise"} if placement == "layerwise" else {}))

    model = build(0, saved_as)
    named = None  # no DTensor placement describes an owner layout: to_dtensor names the routes that work
    try:
        next(p for p in model.parameters() if isinstance(p, shardtensor.ShardedParam)).to_dtensor()
    except NotImplementedError as exc:
        named = "save_checkpoint" in str(exc) and "full_state_dict" in str(exc)
    saved = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}
    shardtensor.save_checkpoint(path, model)
    fresh = build(1, loaded_as)
    shardtensor.load_checkpoint(path, fresh)
    loaded = shardtensor.full_state_dict(fresh)
    return {"wrong": sorted(k for k, v in saved.items() if not torch.equal(v, loaded[k])), "to_dtensor named": named}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("saved_as,loaded_as", [("layerwise", "layerwise"), ("layerwise", "dim0"),
                                                ("dim0", "layerwise")])
def test_a_layerwise_checkpoint_loads_back_exactly(tmp_path, world, saved_as, loaded_as):
    """DCP's metadata listed dim-0 chunks while each owner wrote its whole tensor (the DTensor view said
    ``Shard(0)``): a layer-wise checkpoint loaded back every weight but the LayerNorm's wrong, silently, and one
    loaded across placements failed half-way.  The chunks come from the layout now; a plain model reads the
    files too."""
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    for out in run_on_ranks(world, layerwise_checkpoint_case, path, saved_as, loaded_as):
        assert out == {"wrong": [], "to_dtensor named": True if saved_as == "layerwise" else None}, out
    plain, want = _build(1), _build(0).state_dict()
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert all(torch.equal(v, want[k]) for k, v in state["model"].items())


def muon_checkpoint_case(path: str) -> dict:
    """``save_checkpoint`` / ``load_checkpoint`` handed Muon (per-rank inner optimizers), and a path with no
    checkpoint: named errors on every rank, nothing changed."""
    import shardtensor
    from shardtensor.checkpoint_files import CheckpointError
    from shardtensor.optim import Muon

    model = shardtensor.shard_module(_build(0), placement="layerwise")
    opt = Muon(model, lr=0.02, adamw_lr=1e-2)
    before = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}
    out = {}
    for what, call in (("save", lambda: shardtensor.save_checkpoint(path, model, opt)),
                       ("load", lambda: shardtensor.load_checkpoint(path, model, opt)),
                       ("missing", lambda: shardtensor.load_checkpoint(path + "-none", model))):
        try:
            call()
            out[what] = "no error"
        except CheckpointError as exc:
            out[what] = str(exc)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in shardtensor.full_state_dict(model).items())
    return out


def test_checkpoints_handed_muon_or_no_checkpoint_name_the_fix(tmp_path):
    """Helper D: ``load_checkpoint(path, model, muon)`` raised ``AttributeError: 'Muon' object has no attribute
    'state'``; a path with no checkpoint said the checksum file was missing and suggested
    ``verify_checksums=False``."""
    for out in run_on_ranks(2, muon_checkpoint_case, str(tmp_path / "ckpt")):
        assert "Muon is not a torch.optim.Optimizer" in out["save"] and "torch.save(optimizer.state_dict())" in out["save"], out
        assert "Muon is not a torch.optim.Optimizer" in out["load"], out
        assert "no checkpoint there" in out["missing"], out
        assert out["unchanged"], out


def _muon_misuse_case(case: str) -> dict:
    import torch.distributed as dist

    import shardtensor
    from shardtensor.optim import Muon

    rank = dist.get_rank()
    meta = case == "built_before_materialize"
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    shardtensor.shard_module(model, placement="layerwise")
    opt = Muon(model, lr=0.02, adamw_lr=1e-2)
    if meta:
        torch.manual_seed(0)
        shardtensor.materialize(model)
    before = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1 + rank))
    out: dict = {}
    try:
        if case == "step_in_no_sync":
            with shardtensor.gradient_sync(model, False):
                model(x).square().mean().backward()
                opt.step()
        elif case == "unaveraged_grad":
            params = list(model.parameters())
            for p, g in zip(params, torch.autograd.grad(model(x).square().mean(), params)):
                p.grad = g  # this rank's own gradient (DDP-style code)
            opt.step()
        elif case == "after_unshard":
            shardtensor.unshard_module(model)
            model(x).square().mean().backward()
            opt.step()
        else:  # built_before_materialize: trains, as AdamW built there does
            model(x).square().mean().backward()
            opt.step()
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    state = shardtensor.full_state_dict(model) if case != "after_unshard" else dict(model.state_dict())
    out["moved"] = max((v - before[k]).abs().max().item() for k, v in state.items())
    return out


# Muon steps each owner's plain local tensors, which the checks every torch.optim step gets never saw: a step after
# unshard_module moved nothing, one inside gradient_sync(model, False) stepped on zeros (and decayed), one on a
# rank's own .grad stepped it unaveraged (0.02 off), all silently; one built before materialize held meta tensors.
@pytest.mark.parametrize("case,named", [("step_in_no_sync", "still deferred"),
                                        ("unaveraged_grad", "never averaged"),
                                        ("after_unshard", "unshard_module"),
                                        ("built_before_materialize", None)])
def test_muon_steps_get_the_checks_of_torch_optimizers(case, named):
    for out in run_on_ranks(2, _muon_misuse_case, case):
        if named is None:
            assert out["error"] is None and out["moved"] > 1e-4, out
        else:
            assert out["error"] is not None and named in out["error"] and "Muon" in out["error"], out
            assert out["moved"] == 0.0, out
