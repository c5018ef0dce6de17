"""torch.compile(fullgraph=True) of sharded models: no graph break, the numbers of eager sharded and unsharded.

Ops on ShardedParams take the traced path while torch.compile traces (functional all-gathers in the graph, see
``shardtensor/_traced.py``); each gradient is reduce-scattered inside the compiled backward
(``shardtensor/_traced_grads.py``).  Each rank trains on its own micro-batch for 3 AdamW steps; the reference trains one unsharded copy on
all of them.  Most cases use the ``aot_eager`` backend (AOTAutograd traces forward and backward through our
``__torch_dispatch__`` exactly as for inductor, minus inductor's C++ compile); one case runs inductor.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardtensor
from rank_pool import run_on_ranks
from shardtensor.models import GPT, GPTConfig

STEPS = 3
VOCAB = 65  # odd: the embedding and the head have a padding row at world 2


def _batches(world: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(world)] for _ in range(STEPS)]


def _loss(run, idx: torch.Tensor) -> torch.Tensor:
    logits = run(idx)
    logits = getattr(logits, "logits", logits)  # transformers returns a ModelOutput
    return F.cross_entropy(logits.flatten(0, 1), idx.roll(1, dims=1).flatten())


OPTIMIZERS = {  # eps=1e-3: a parameter whose true gradient is 0 (the key part of qkv.bias: softmax ignores it)
    # gets rounding noise that a tiny eps would blow up to +-lr per step, differently per backend and summation order.
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3, fused=True),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-1, momentum=0.9, weight_decay=0.01),
}


def _train(model: nn.Module, run, batches, *, sharded: bool, optimizer: str = "adamw",
           step_backend: str = "") -> tuple[list[float], dict]:
    """``step_backend``: compile ``opt.step`` with it (see [Note: a compiled optimizer step])."""
    opt = OPTIMIZERS[optimizer](model.parameters())
    opt_step = torch.compile(opt.step, backend=step_backend) if step_backend else opt.step
    losses = []
    for step in batches:
        if sharded:
            loss = _loss(run, step[dist.get_rank()])
        else:
            loss = sum(_loss(run, b) for b in step) / len(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt_step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if sharded:
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
    state = shardtensor.full_state_dict(model) if sharded else model.state_dict()
    return losses, {k: v.detach().clone() for k, v in state.items()}


def _gpt(tied: bool) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16))
    if not tied:
        model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return GPT2LMHeadModel(cfg)  # tied embeddings (the default)


def compile_case(world: int, build: str, gather: str, backend: str) -> tuple:
    """(compiled sharded, eager sharded, unsharded) training results and the graph-break count."""
    import torch._dynamo

    model = {"tied": lambda: _gpt(True), "untied": lambda: _gpt(False), "gpt2": _gpt2,
             "checkpointed": _checkpointed_gpt}[build]()
    batches = _batches(world)
    plain = copy.deepcopy(model)
    reference = _train(plain, plain, batches, sharded=False)
    eager = shardtensor.shard_module(copy.deepcopy(model), gather=gather)
    eager_result = _train(eager, eager, batches, sharded=True)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sharded = shardtensor.shard_module(model, gather=gather)
    compiled = torch.compile(sharded, backend=backend, fullgraph=True)  # a graph break would raise
    result = _train(sharded, compiled, batches, sharded=True)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return result, eager_result, reference, breaks


def _assert_same(result, expected, tol: float) -> None:
    (losses, state), (ref_losses, ref_state) = result, expected
    assert losses == pytest.approx(ref_losses, abs=tol, rel=tol), (losses, ref_losses)
    assert state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=tol, atol=tol, msg=key)


def _check(results) -> None:
    for result, eager, reference, breaks in results:
        assert breaks == 0
        _assert_same(result, eager, 1e-5)
        _assert_same(result, reference, 1e-4)


# "overlapped" (the default) has gather units per block: under compile each unit is gathered by one node per
# phase, and its gradients are reduced together once the compiled backward has produced them all; "sequential"
# has no units: one gather per parameter read, per-parameter reductions.
def test_compiled_tied_gpt_fullgraph_equals_eager_and_unsharded():
    _check(run_on_ranks(2, compile_case, 2, "tied", "overlapped", "aot_eager"))


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_compiled_transformers_gpt2_fullgraph():
    _check(run_on_ranks(2, compile_case, 2, "gpt2", "overlapped", "aot_eager"))


def test_compiled_untied_gpt_inductor_sequential():
    _check(run_on_ranks(2, compile_case, 2, "untied", "sequential", "inductor"))


def merged_reductions_case(world: int, build: str) -> tuple:
    """compile_case under inductor, overlapped, and the sizes of the reductions the compiled backward issued."""
    from shardtensor.reduce import GradSync

    sizes, real = [], GradSync.reduce_compiled_together

    def counted(self, params, *args):
        sizes.append(len(params))
        return real(self, params, *args)

    GradSync.reduce_compiled_together = counted
    try:
        return compile_case(world, build, "overlapped", "inductor"), sizes
    finally:
        GradSync.reduce_compiled_together = real


@pytest.mark.parametrize("build,root", [("untied", 5), ("tied", 4)])
def test_inductor_merges_each_units_gradient_reductions_and_trains_as_eager(build, root):
    """Under inductor the post-grad pass merges a unit's reductions (see [Note: a unit's gradients reduced
    together under compile]): the block's 12 gradients in one reduction, the root's in another, per step: two
    embeddings, final norm and the untied head (5), or, tied, the embedding's two parts (its read by the head and
    by the embedding) summed into one gradient (4); the numbers are eager's and the unsharded model's."""
    for results, sizes in run_on_ranks(2, merged_reductions_case, 2, build):
        _check([results])
        steps = len(_batches(2))
        assert sorted(sizes) == sorted([12, root] * steps), sizes


def compiled_collectives_per_step(world: int, layers: int, gather: str = "overlapped") -> tuple[int, int, int, int]:
    """(eager collectives, unit gathers, per-read gathers, reductions inside the compiled backward) of a warm
    compiled step, each collective behind one identity check.  Eager: the clipping norm's all-reduce.  The
    graph's gathers (see [Note: unit gathers under compile]) and reductions (see [Note: a gradient reduced
    inside the compiled backward]) are counted apart."""
    import torch._dynamo

    from shardtensor import _comm
    from shardtensor._unit import _Unit
    from shardtensor.reduce import GradSync

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=layers, n_head=2,
                                                   n_embd=16)), gather=gather)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts, calls = [], {"unit": 0, "read": 0, "reduce": 0}
    real = {"read": _comm.all_gather_rows, "unit": _Unit.gather_for_graph, "reduce": GradSync.reduce_compiled}

    def counted(kind):
        def call(*args, **kwargs):
            calls[kind] += 1
            return real[kind](*args, **kwargs)
        return call

    _comm.all_gather_rows, _Unit.gather_for_graph = counted("read"), counted("unit")
    GradSync.reduce_compiled = counted("reduce")
    try:
        for idx in _batches(world)[0]:
            before = shardtensor.identity_check_stats()["checks"]
            calls.update(unit=0, read=0, reduce=0)
            _loss(run, idx).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            checks = shardtensor.identity_check_stats()["checks"] - before
            counts.append((checks - calls["unit"] - calls["read"] - calls["reduce"], calls["unit"], calls["read"],
                           calls["reduce"]))
    finally:
        _comm.all_gather_rows, _Unit.gather_for_graph = real["read"], real["unit"]
        GradSync.reduce_compiled = real["reduce"]
    return counts[-1]


def test_compiled_step_gathers_each_unit_once_per_phase_and_reduces_each_gradient_in_the_graph():
    """Overlapped: a block's parameters are gathered by one node in the forward graph and one in the backward
    (none per read), and each of its 12 gradients is reduced inside the compiled backward where autograd has
    it whole (no whole gradient leaves the graph): two more blocks cost four more gathers and 24 more
    reductions, and nothing more outside the graph (where the clipping norm is all-reduced)."""
    (one, one_units, one_reads, one_reduced), (three, three_units, three_reads, three_reduced) = (
        run_on_ranks(2, compiled_collectives_per_step, 2, layers)[0] for layers in (1, 3))
    assert one == three <= 2, (one, three)  # (the clipping norm)
    assert one_reads == three_reads == 0, (one_reads, three_reads)  # (the tied head's gradient too: shard-wise)
    assert three_units - one_units == 4 and one_units == 3, (one_units, three_units)  # (the root: once, see [Note:
    # the root unit under compile])
    # one per sharded parameter read: a block's 12, the root's 4 and the tied embedding's second read (the head),
    # whose two reduced parts autograd adds shard-wise (see [Note: a gradient reduced inside the compiled backward])
    assert three_reduced - one_reduced == 24 and one_reduced == 12 + 5, (one_reduced, three_reduced)


def test_compiled_sequential_mode_gathers_per_read_and_again_in_the_backward():
    """Sequential (the lowest peak): no units, each parameter gathered where the graph reads it: each more block
    costs its 12 parameters read in the forward and, in the backward, its 4 matmul weights and 2 layer norms'
    weights and biases again (not the forward's gathered tensors kept alive until the backward: see [Note: a
    gather where it is read])."""
    (_, one_units, one_reads, _), (_, three_units, three_reads, _) = (
        run_on_ranks(2, compiled_collectives_per_step, 2, layers, "sequential")[0] for layers in (1, 3))
    assert one_units == three_units == 0
    assert three_reads - one_reads == 2 * (12 + 8), (one_reads, three_reads)


def accumulation_case(compiled: bool, micro: int = 3) -> dict:
    """Gradient accumulation with ``gradient_sync(model, False)`` on all micro-batches but the last, 2 steps:
    the compiled backward defers each whole gradient as the eager hook does and reduces the sum once.  (The
    tied embedding's gradient came to the deferral in two parts per backward here, and the second part threw
    the first away, taken for a ``.grad`` the script had zeroed: 0.15 off after one synced step.)"""
    import torch._dynamo

    torch._dynamo.reset()
    model = shardtensor.shard_module(_gpt(tied=True))
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        for i in range(micro):
            with shardtensor.gradient_sync(model, i == micro - 1):
                _loss(run, torch.randint(0, VOCAB, (2, 8), generator=gen)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in shardtensor.full_state_dict(model).items()}


def test_compiled_gradient_accumulation_without_sync_equals_eager():
    compiled = run_on_ranks(2, accumulation_case, True, timeout=300)
    eager = run_on_ranks(2, accumulation_case, False, timeout=300)
    for got, want in zip(compiled, eager):
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=key)


def graph_keys_case() -> list:
    """The key a compiled backward reduces a gradient under, for models sharded, dropped and sharded again."""
    import gc

    from shardtensor import _traced_grads

    models = [shardtensor.shard_module(nn.Linear(4, 4)) for _ in range(2)]
    dropped = _traced_grads.key_of(models[0].weight._layout)
    del models[0]
    gc.collect()
    models.append(shardtensor.shard_module(nn.Linear(4, 4)))
    live = [_traced_grads.key_of(m.weight._layout) for m in models]
    return live, dropped in _traced_grads._RECORDS, all(k in _traced_grads._RECORDS for k in live)


def test_graph_keys_of_gradients_are_never_given_twice():
    # A key numbered by the live models came back once one was gone: a compiled backward reduced "12/head.bias"
    # of another model, or (where the ranks' garbage collection differed) raised on one rank while the other
    # waited in the collective.  A dropped model's keys leave the table (a process sharding many models).
    for keys, dropped_kept, live_kept in run_on_ranks(2, graph_keys_case):
        assert None not in keys and len(set(keys)) == 2, keys
        assert not dropped_kept and live_kept


def compile_order_case(world: int, order: str) -> tuple:
    """Sharding where the user compiled first: ``shard_module(torch.compile(model))``, or a model whose unsharded
    compiled graphs already ran (Dynamo must trace again, over the sharded parameters)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, batches = _gpt(True), _batches(world)
    plain = copy.deepcopy(model)
    reference = _train(plain, plain, batches, sharded=False)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    if order == "compiled, then sharded":
        shardtensor.shard_module(run)
        result = _train(run, run, batches, sharded=True)
    else:
        _loss(run, batches[0][0]).backward()  # the unsharded model's graphs exist
        model.zero_grad(set_to_none=True)
        shardtensor.shard_module(model)
        result = _train(model, run, batches, sharded=True)
    return result, reference, sum(torch._dynamo.utils.counters["graph_break"].values())


@pytest.mark.parametrize("order", ["compiled, then sharded", "run compiled unsharded, then sharded"])
def test_sharding_a_model_compiled_before_trains_as_the_unsharded_one(order):
    for result, reference, breaks in run_on_ranks(2, compile_order_case, 2, order):
        assert breaks == 0
        _assert_same(result, reference, 1e-4)


class _CheckpointedGPT(nn.Module):
    """The GPT with each block under non-reentrant activation checkpointing (its forward runs again in the
    backward, so a unit's forward gathers are traced a second time inside the backward graph)."""

    def __init__(self, gpt: nn.Module):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        g = self.gpt
        x = g.wte(idx) + g.wpe(torch.arange(idx.shape[1]))
        for block in g.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return g.lm_head(g.ln_f(x))


def _checkpointed_gpt() -> nn.Module:
    torch.manual_seed(0)
    return _CheckpointedGPT(GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=2, n_head=2, n_embd=16)))


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_compiled_activation_checkpointing_equals_eager_and_unsharded(gather):
    _check(run_on_ranks(2, compile_case, 2, "checkpointed", gather, "aot_eager"))


def subgroup_case(world: int) -> tuple:
    """Two models, each sharded over its own half of 4 ranks (``group=``), compiled and eager."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank creates every group)
    group = halves[dist.get_rank() // 2]
    model = _gpt(tied=True)
    eager = shardtensor.shard_module(copy.deepcopy(model), group=group)
    sharded = shardtensor.shard_module(model, group=group)
    run = torch.compile(sharded, backend="aot_eager", fullgraph=True)
    states = []
    for module, call in ((sharded, run), (eager, eager)):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, eps=1e-3)
        gen = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(STEPS):
            _loss(call, torch.randint(0, VOCAB, (2, 8), generator=gen)).backward()
            opt.step()
            opt.zero_grad()
        states.append(shardtensor.full_state_dict(module))
    return states, sum(torch._dynamo.utils.counters["graph_break"].values())


def test_a_model_sharded_over_a_subgroup_compiles_and_trains_as_eager():
    # (Dynamo's guards deepcopy the layout in a ShardedParam's flatten context; its subgroup could not be copied.)
    for (compiled, eager), breaks in run_on_ranks(4, subgroup_case, 4):
        assert breaks == 0
        for key, value in eager.items():
            torch.testing.assert_close(compiled[key], value, rtol=1e-5, atol=1e-5, msg=key)


def compiled_wrapper_state_case() -> tuple:
    """The full state dict of ``torch.compile(sharded)`` (an ``OptimizedModule``, whose own keys start
    ``_orig_mod.``), and a load of an unsharded state dict through it."""
    torch.manual_seed(0)
    plain = _gpt(tied=False)
    wrapper = torch.compile(shardtensor.shard_module(copy.deepcopy(plain)), backend="aot_eager")
    for p in plain.parameters():
        p.data.add_(1.0)
    keys = sorted(shardtensor.full_state_dict(wrapper))
    shardtensor.load_full_state_dict(wrapper, plain.state_dict())
    back = shardtensor.full_state_dict(wrapper)
    return keys, sorted(plain.state_dict()), all(torch.equal(back[k], v) for k, v in plain.state_dict().items())


def test_full_state_dict_of_a_compiled_wrapper_has_the_models_keys():
    for keys, plain_keys, loaded in run_on_ranks(2, compiled_wrapper_state_case):
        assert keys == plain_keys and loaded


def mixed_precision_case(world: int) -> tuple:
    """bf16 compute (param_dtype): the traced gather casts before the collective as the eager Gatherer does."""
    import torch._dynamo

    model, batches = _gpt(True), _batches(world)
    eager = shardtensor.shard_module(copy.deepcopy(model), param_dtype=torch.bfloat16)
    eager_result = _train(eager, eager, batches, sharded=True)
    torch._dynamo.reset()
    sharded = shardtensor.shard_module(model, param_dtype=torch.bfloat16)
    result = _train(sharded, torch.compile(sharded, backend="aot_eager", fullgraph=True), batches, sharded=True)
    float32 = _train(*[shardtensor.shard_module(_gpt(True))] * 2, batches, sharded=True)
    return result, eager_result, float32


def test_compiled_mixed_precision_equals_eager_mixed_precision():
    for result, eager, float32 in run_on_ranks(2, mixed_precision_case, 2):
        _assert_same(result, eager, 1e-3)
        assert result[0] != pytest.approx(float32[0], abs=1e-5)  # it did compute in bf16


def cache_key_case(world: int) -> list[bool]:
    """AOTAutograd's cache key: the same in every process that sharded the same models in the same order (no
    object ids), different where the graph would be."""
    from shardtensor import _traced

    one = shardtensor.shard_module(_gpt(False))
    two = shardtensor.shard_module(_gpt(False))
    bf16 = shardtensor.shard_module(_gpt(False), param_dtype=torch.bfloat16)
    seq_one, seq_two = (shardtensor.shard_module(_gpt(False), gather="sequential") for _ in range(2))  # no units
    w1, w2, w3 = one.wte.weight, two.wte.weight, bf16.wte.weight
    key = w1._stable_hash_for_caching()
    fields = list(_traced.cache_fields(one.blocks[0].attn.qkv.weight))
    rank_field = 10
    assert fields[rank_field] == dist.get_rank()
    fields[rank_field] = "rank"  # (the one field ranks differ in)
    everywhere = [None] * world
    dist.all_gather_object(everywhere, fields)
    return [all(f == everywhere[0] for f in everywhere),       # equal in every process (no object ids)
            key == w1._stable_hash_for_caching(),
            key != w2._stable_hash_for_caching(),              # another model's unit: another graph
            key != w1.t()._stable_hash_for_caching(),          # a view traces other ops
            key != w3._stable_hash_for_caching(),              # the gather casts to bf16
            key != one.blocks[0].attn.qkv.weight._stable_hash_for_caching(),
            # another model's gradient reductions (their keys are in the backward graph): a cached graph reduced
            # a gradient no model of the process had
            seq_one.wte.weight._stable_hash_for_caching() != seq_two.wte.weight._stable_hash_for_caching()]


def test_cache_key_is_stable_and_tells_graphs_apart():
    for checks in run_on_ranks(2, cache_key_case, 2):
        assert all(checks), checks


def changed_after_sharding_case(change: str, compiled: bool = True) -> dict:
    """A compiled forward runs no root hook: what the root's checks catch in eager must be named at the step,
    on every rank, before any update (a parameter replaced after ``shard_module``).  A parameter frozen at shard
    time and unfrozen later needs no hook under compile: its gradient is reduced in the compiled backward
    (``compiled=False``: the same steps eagerly, whose root hook attaches the parameter's at the forward)."""
    model = _gpt(tied=True)
    if change.startswith("unfrozen"):
        model.blocks[0].fc.requires_grad_(False)
    shardtensor.shard_module(model)
    if change == "replaced":
        model.ln_f.weight = nn.Parameter(torch.ones(16))
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batches(dist.get_world_size())[0][dist.get_rank()]
    if change == "unfrozen_after_an_eager_gather":  # an eager read (logging) runs the checks before the unfreeze
        with torch.no_grad():
            model.wte(batch)
    if change.startswith("unfrozen"):
        model.blocks[0].fc.requires_grad_(True)
    before = {k: v.clone() for k, v in shardtensor.full_state_dict(model).items()}
    _loss(run, batch).backward()
    out = {"grad_sharded": type(model.blocks[0].fc.weight.grad).__name__ == "ShardedParam"}
    try:
        opt.step()
        out["error"] = "no error"
    except RuntimeError as exc:
        out["error"] = str(exc)
    after = shardtensor.full_state_dict(model)
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    out["after"] = after
    return out


def test_a_compiled_model_with_a_parameter_replaced_after_sharding_is_named_at_the_step_before_any_update():
    want = "'ln_f.weight' was converted or replaced after shard_module"
    for rank, r in enumerate(run_on_ranks(2, changed_after_sharding_case, "replaced", timeout=300)):
        assert want in r["error"] and "Fix:" in r["error"] and r["unchanged"], (rank, r["error"])


@pytest.mark.parametrize("change", ["unfrozen", "unfrozen_after_an_eager_gather"])
def test_a_parameter_unfrozen_after_sharding_trains_compiled_as_eager(change):
    compiled = run_on_ranks(2, changed_after_sharding_case, change, timeout=300)
    eager = run_on_ranks(2, changed_after_sharding_case, change, False, timeout=300)
    for rank, (r, e) in enumerate(zip(compiled, eager)):
        assert r["error"] == e["error"] == "no error" and r["grad_sharded"] and not r["unchanged"], (rank, r["error"])
        for key, value in e["after"].items():
            torch.testing.assert_close(r["after"][key], value, rtol=1e-5, atol=1e-5, msg=key)


def compiled_meta_model_case() -> str:
    with torch.device("meta"):
        model = _gpt(tied=True)
    shardtensor.shard_module(model)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    try:
        _loss(run, _batches(dist.get_world_size())[0][dist.get_rank()]).backward()
    except Exception as exc:  # noqa: BLE001 (the compiler wraps errors raised while it traces)
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_compiled_meta_model_without_materialize_names_the_fix():
    # The compiled forward runs no eager root hook: the compiler failed with "Tensor device mismatch ... cpu and
    # meta", naming no fix.  The traced hook reads the parameters' devices once, keeping no state.
    for message in run_on_ranks(2, compiled_meta_model_case, timeout=300):
        assert "is on the meta device" in message and "shardtensor.materialize(model)" in message, message



def compiled_divergence_case() -> str:
    """Rank 0 runs an extra compiled evaluation, then both train: the graph's gathers carry identity records (on
    gloo), so the ranks' next collectives differ and every rank names it, instead of waiting for the timeout
    (rank 0's extra gathers met rank 1's training gathers: the same parameters, mixed into wrong numbers)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16)))
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    idx = _batches(2)[0][dist.get_rank()]
    _loss(run, idx).backward()  # compiled on both ranks
    try:
        if dist.get_rank() == 0:
            with torch.no_grad():
                run(idx)
        _loss(run, idx).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except shardtensor.DivergenceError as exc:
        return str(exc)
    return "no error"


def test_ranks_diverging_inside_compiled_code_are_named():
    for message in run_on_ranks(2, compiled_divergence_case, timeout=120):
        assert "diverged" in message and "(compiled)" in message, message
        assert "compile the model on every rank" not in message  # (both ranks run compiled code here)


def compiled_on_one_rank_case() -> str:
    """``torch.compile`` under ``if rank == 0:``: rank 0's step is the compiled graph's, rank 1's the eager one."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = shardtensor.shard_module(GPT(GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16)))
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if dist.get_rank() == 0 else model
    try:
        for idx in _batches(2)[0]:
            _loss(run, idx).backward()
    except shardtensor.DivergenceError as exc:
        return str(exc)
    return "no error"


def test_a_model_compiled_on_one_rank_only_is_named_with_the_fix():
    for message in run_on_ranks(2, compiled_on_one_rank_case, timeout=120):
        assert "diverged" in message and "compile the model on every rank" in message, message
