"""FSDP-style training code keeps working with shard_module: meta-device init, activation checkpointing,
no_grad / inference_mode evaluation, gradient_sync (no_sync), unshard_module, torch.compile, and a Hugging Face
model.  Each rank trains on its own micro-batch; the reference trains one unsharded copy on all of them."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardtensor
from rank_pool import run_on_ranks


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 3 * dim)
        self.fc2 = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class Net(nn.Module):
    """Embedding, a stack of blocks (optionally checkpointed: ``ckpt=True`` non-reentrant, ``"reentrant"``), a head."""

    def __init__(self, vocab: int = 11, dim: int = 6, layers: int = 2, ckpt: "bool | str" = False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(layers)])
        self.head = nn.Linear(dim, vocab)
        self.ckpt = ckpt

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            if self.ckpt == "selective":
                x = checkpoint(block, x, use_reentrant=False, context_fn=_save_matmuls_only)
            else:
                x = checkpoint(block, x, use_reentrant=self.ckpt == "reentrant") if self.ckpt else block(x)
        return self.head(x)


def _save_matmuls_only():
    """Selective activation checkpointing: keep the matmuls' outputs, recompute the rest (torch's own recipe)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def policy(ctx, op, *args, **kwargs):
        mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        return CheckpointPolicy.MUST_SAVE if op in mm else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _loss(model, idx):
    logits = model(idx)
    return nn.functional.cross_entropy(logits.flatten(0, 1), idx.roll(1, dims=1).flatten())


def _batches(world: int, steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 11, (2, 5), generator=gen) for _ in range(world)] for _ in range(steps)]


def _reference(model, batches, lr=1e-2, opt_cls=torch.optim.AdamW) -> tuple[list[float], dict]:
    opt = opt_cls(model.parameters(), lr=lr)
    losses = []
    for step in batches:
        loss = sum(_loss(model, b) for b in step) / len(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _sharded(model, batches, lr=1e-2, opt_cls=torch.optim.AdamW, compiled=None) -> tuple[list[float], dict]:
    rank = dist.get_rank()
    opt = opt_cls(model.parameters(), lr=lr)
    run = compiled if compiled is not None else model
    losses = []
    for step in batches:
        loss = _loss(run, step[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, shardtensor.full_state_dict(model)


def _assert_same_training(result, reference, atol=1e-10):
    (losses, state), (ref_losses, ref_state) = result, reference
    assert losses == pytest.approx(ref_losses, abs=atol, rel=atol), (losses, ref_losses)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=atol, atol=atol, msg=key)


# --------------------------------------------------------------------------------------- torch.func transforms
class _Regressor(nn.Module):
    """Two blocks on a continuous input (derivatives with respect to it: a Jacobian penalty, a PINN's residual)."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.blocks = nn.Sequential(Block(dim), Block(dim))
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


def func_transforms_case(gather: str) -> tuple:
    from torch.func import grad, jacrev, vmap

    torch.manual_seed(0)
    model = _Regressor().double()
    reference = copy.deepcopy(model)
    sharded = shardtensor.shard_module(model, gather=gather)
    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    results = []
    for m in (sharded, reference):
        jacobian = jacrev(m)(x[0])
        per_sample = vmap(grad(lambda xi, m=m: m(xi).square().sum()))(x)
        penalty = jacrev(lambda xi, m=m: m(xi).sum(0))(x).square().sum()  # then a step on the penalised loss
        loss = m(x).square().mean() + penalty
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss.backward()
        opt.step()
        results.append([jacobian.detach(), per_sample.detach(), loss.detach(),
                        shardtensor.full_state_dict(m) if m is sharded else dict(m.state_dict())])
    return results


# torch.func transforms of the input ran a gather unit's forward hook inside the transform: every tensor the hook
# built for its collectives was the transform's own (no storage), and overlapped mode failed with torch's "Cannot
# access data pointer of Tensor that doesn't have storage"; then the unit's autograd nodes were refused by functorch.
@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_torch_func_transforms_of_the_input_equal_unsharded(gather):
    for sharded, reference in run_on_ranks(2, func_transforms_case, gather):
        for got, want in zip(sharded, reference):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def per_sample_grads_over_params_case() -> str:
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = shardtensor.shard_module(_Regressor().double())
    x = torch.randn(3, 6, dtype=torch.float64)

    def loss(params, xi):
        return functional_call(model, params, (xi[None],)).square().sum()

    try:  # the per-sample-gradients tutorial's recipe, with the sharded parameters themselves
        vmap(grad(loss), in_dims=(None, 0))(dict(model.named_parameters()), x)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


# The refusal said "converted or replaced ... functional_call takes the sharded parameters themselves", which is
# what the user had passed.
def test_torch_func_transforms_over_the_parameters_are_named_as_such():
    for message in run_on_ranks(2, per_sample_grads_over_params_case):
        assert "torch.func transform" in message and "over the parameters" in message, message


# ---------------------------------------------------------------------------------------------- checkpointing
def ckpt_case(world: int, ckpt: "bool | str", gather: str) -> tuple:
    torch.manual_seed(0)
    model = Net(ckpt=ckpt).double()
    reference = _reference(copy.deepcopy(model), _batches(world, 3))
    return _sharded(shardtensor.shard_module(model, gather=gather), _batches(world, 3)), reference


# Reentrant checkpointing runs each block's backward as a backward of its own, inside the outer one: the gather
# units (overlapped mode) must not take it for a new backward that replaced a failed one (they once dropped the
# gradient that arrived first, a block's last bias, silently).
@pytest.mark.parametrize("world,ckpt,gather", [(1, True, "sequential"), (2, True, "sequential"),
                                               (2, True, "overlapped"), (2, "reentrant", "overlapped"),
                                               (2, "reentrant", "sequential")])
def test_activation_checkpointing_equals_unsharded(world, ckpt, gather):
    for result, reference in run_on_ranks(world, ckpt_case, world, ckpt, gather):
        _assert_same_training(result, reference)


def selective_ckpt_case(gather: str, whole_model: bool) -> tuple:
    torch.manual_seed(0)
    model = Net(ckpt=False if whole_model else "selective").double()
    reference = _reference(copy.deepcopy(model), _batches(2, 3))
    sharded = shardtensor.shard_module(model, gather=gather)
    run = (lambda idx: checkpoint(sharded, idx, use_reentrant=False, context_fn=_save_matmuls_only)) \
        if whole_model else None
    return _sharded(sharded, _batches(2, 3), compiled=run), reference


# Selective checkpointing records every op of the region in the forward and requires the recompute to run the same:
# the library's hooks ran their gathers and waits inside its mode, and the recompute met ops (a pending reduction
# finished, a gather already landed) the forward had not run: torch's error on one rank, a hang on the other.
@pytest.mark.parametrize("gather", ["overlapped", "auto", "sequential"])
@pytest.mark.parametrize("whole_model", [False, True])
def test_selective_activation_checkpointing_equals_unsharded(gather, whole_model):
    for result, reference in run_on_ranks(2, selective_ckpt_case, gather, whole_model, timeout=120):
        _assert_same_training(result, reference)


# ---------------------------------------------------------------------------------------------- evaluation
def eval_case() -> tuple:
    torch.manual_seed(1)
    model = Net().double()
    reference = copy.deepcopy(model)
    shardtensor.shard_module(model)
    idx = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = model(idx)
    with torch.inference_mode():
        b = model(idx)
    model.eval()
    c = model(idx).detach()
    expected = reference(idx).detach()
    return (torch.equal(a, expected), torch.equal(b, expected), torch.equal(c, expected), a.requires_grad,
            all(p.grad is None for p in model.parameters()))


def test_no_grad_and_inference_mode_equal_unsharded():
    for same_no_grad, same_inference, same_eval, requires_grad, no_grads in run_on_ranks(2, eval_case):
        assert same_no_grad and same_inference and same_eval and not requires_grad and no_grads


# ---------------------------------------------------------------------------------------------- meta init
def _peak_cpu_bytes(fn) -> int:
    """Peak of live CPU allocations while ``fn`` runs, from the profiler's allocation events, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start)
    live = peak = 0
    for event in events:
        live += event.cpu_memory_usage
        peak = max(peak, live)
    return peak


class Deep(nn.Module):
    def __init__(self, dim: int, layers: int):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(self.layers(x))


def meta_case(dim: int, layers: int) -> dict:
    world = dist.get_world_size()
    torch.manual_seed(4)
    reference = Deep(dim, layers)  # what reset_parameters draws unsharded with this seed
    with torch.device("meta"):
        model = Deep(dim, layers)
    shardtensor.shard_module(model)
    torch.manual_seed(4)
    peak = _peak_cpu_bytes(lambda: shardtensor.materialize(model, device="cpu"))  # CPU RNG, as the reference
    state = shardtensor.full_state_dict(model)
    same = all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    # and it trains like the unsharded model
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, dim, generator=gen) for _ in range(world)]
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    (sum(reference(x).square().mean() for x in xs) / world).backward()
    ref_opt.step()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(xs[dist.get_rank()]).square().mean().backward()
    opt.step()
    trained = shardtensor.full_state_dict(model)
    close = all(torch.allclose(trained[k], v, atol=1e-6) for k, v in reference.state_dict().items())
    full_bytes = sum(p.numel() * 4 for p in reference.parameters())
    shard_bytes = sum(p.to_local().numel() * 4 for p in model.parameters() if isinstance(p, shardtensor.ShardedParam))
    return {"peak": peak, "same": same, "close": close, "full": full_bytes, "shards": shard_bytes,
            "largest": dim * dim * 4}


def test_meta_init_allocates_shards_and_draws_unsharded_values():
    # 8 layers of 128x128 on 4 ranks: the model is 0.53 MB, a rank's shards 0.13 MB, the largest parameter 64 KiB.
    for r in run_on_ranks(4, meta_case, 128, 8):
        assert r["same"] and r["close"]
        # peak = own shards + one full parameter being drawn (+ its row copy) + small change: far below the model
        assert r["peak"] <= r["shards"] + 2 * r["largest"] + 16 * 1024, r
        assert r["peak"] < r["full"] / 2, r


def padding_rows_case(vocab: int, padding_idx: int) -> dict:
    """nn.Embedding(padding_idx=...) built on meta and materialized: its reset_parameters() zeroes the padding row
    through a row view; and writes through dim-0 row views done by hand, against the unsharded tensor."""
    torch.manual_seed(11)
    reference = nn.Sequential(nn.Embedding(vocab, 3, padding_idx=padding_idx), nn.Linear(3, 2))
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(vocab, 3, padding_idx=padding_idx), nn.Linear(3, 2))
    shardtensor.shard_module(model)
    torch.manual_seed(11)
    shardtensor.materialize(model, device="cpu")
    full = shardtensor.full_state_dict(model)
    same_init = all(torch.equal(v, reference.state_dict()[k]) for k, v in full.items())
    padding_row_zero = bool((full["0.weight"][padding_idx] == 0).all())
    w, ref = model[0].weight, reference[0].weight
    with torch.no_grad():
        for target in (w, ref):
            target[-1].fill_(2.5)
            target[1:vocab - 1:1].mul_(3.0)
            target[vocab // 2:].add_(1.0)
            target[padding_idx] += 0.5  # Python writes the view back: copy_ of the row onto itself
            target[: vocab // 2] *= 2.0
    same_writes = torch.equal(w.full_tensor(), ref)
    return {"same_init": same_init, "same_writes": same_writes, "padding_row_zero": padding_row_zero}


@pytest.mark.parametrize("world", [2, 4])
def test_writes_through_row_views_land_on_the_rows_owner(world):
    # BERT's word embeddings have padding_idx=0: their reset_parameters() (and Hugging Face's init) zero that row
    # through weight[padding_idx]; materialize() refused it before.  Rows on every rank, first, middle and last.
    # ``w[i] += c`` (helper E) landed, then its write-back was refused as "would drop the update silently".
    for vocab, padding_idx in [(9, 0), (9, 4), (10, 9)]:
        for out in run_on_ranks(world, padding_rows_case, vocab, padding_idx):
            assert out == {"same_init": True, "same_writes": True, "padding_row_zero": True}, (vocab, padding_idx, out)


INITS_AFTER_SHARDING = {
    "orthogonal_": lambda w: nn.init.orthogonal_(w, gain=0.5),  # a draw written through w.view(rows, -1)
    "dirac_": nn.init.dirac_,  # zero_, then w[i, i, k] = 1 through three selects
    "eye_": nn.init.eye_,  # torch.eye(n, m, out=w)
    "trunc_normal_": nn.init.trunc_normal_,
}


def init_after_sharding_case(init: str, shape: tuple, seeded_alike: bool) -> str:
    """An ``nn.init`` function applied to a sharded parameter (``materialize(model, init_fn)``, or a head
    re-initialised for fine-tuning) equals it applied to the unsharded one, or is refused before it writes."""
    rank = dist.get_rank()
    plain = torch.zeros(shape, dtype=torch.float64)
    sharded = shardtensor.ShardedParam.from_full(torch.full(shape, 7.0, dtype=torch.float64), name="w")
    torch.manual_seed(5)
    INITS_AFTER_SHARDING[init](plain)
    torch.manual_seed(5 if seeded_alike else 5 + rank)
    try:
        with torch.no_grad():
            INITS_AFTER_SHARDING[init](sharded)
    except (shardtensor.ShardedOpError, ValueError) as exc:
        untouched = bool((sharded.full_tensor() == 7.0).all())
        return f"{type(exc).__name__} untouched={untouched}: {exc}"
    return f"off {(sharded.full_tensor() - plain).abs().max().item()}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("init", sorted(INITS_AFTER_SHARDING))
def test_inits_after_sharding_equal_the_unsharded_init(init, world):
    # orthogonal_ of a wide matrix transposed its draw in place (refused: t_ of a sharded temporary), of a conv
    # weight wrote through w.view(rows, -1) (refused); dirac_ zeroed the weight, then was refused at its first
    # w[i, i, k] = 1; eye_ was refused (an out= write).  Shapes: tall, wide, rows that do not divide, conv.
    shapes = [(7, 3), (3, 7), (5, 5), (6, 2, 3)] if init != "eye_" else [(7, 3), (3, 7), (5, 5)]
    shapes = [s for s in shapes if init != "dirac_" or len(s) == 3] or [(6, 2, 3)]
    for shape in shapes:
        assert run_on_ranks(world, init_after_sharding_case, init, shape, True) == ["off 0.0"] * world, shape
    if init == "orthogonal_":  # generators apart, outside materialize(): refused, nothing written
        for message in run_on_ranks(world, init_after_sharding_case, init, (3, 7), False):
            assert message.startswith("ValueError untouched=True") and "differs between ranks" in message, message


# ---------------------------------------------------------------------------------------------- no_sync
def no_sync_case(micro: int) -> tuple:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(6)
    base = Net().double()
    synced, deferred = shardtensor.shard_module(copy.deepcopy(base)), shardtensor.shard_module(copy.deepcopy(base))
    batches = _batches(world, micro, seed=7)
    for i, step in enumerate(batches):
        _loss(synced, step[rank]).backward()
        with shardtensor.gradient_sync(deferred, i == micro - 1):
            _loss(deferred, step[rank]).backward()
    state = deferred._shardtensor.grad_sync
    grads = [(n, p.grad.full_tensor(), q.grad.full_tensor())
             for (n, p), q in zip(synced.named_parameters(), deferred.parameters())]
    return [(n, torch.allclose(a, b, rtol=1e-12, atol=1e-14)) for n, a, b in grads], state.deferred_bytes(), \
        state.enabled


@pytest.mark.parametrize("world", [2, 4])
def test_gradient_sync_off_then_on_equals_synced(world):
    for same, deferred_bytes, enabled in run_on_ranks(world, no_sync_case, 3):
        assert all(ok for _, ok in same), same
        assert deferred_bytes == 0 and enabled


# ---------------------------------------------------------------------------------------------- GradScaler
def grad_scaler_case(world: int, gather: str) -> tuple:
    """``torch.amp.GradScaler`` around the sharded step: every rank must skip a step together when any rank's
    gradient rows overflowed (``found_inf`` is all-reduced), or the ranks' shards drift apart silently."""
    torch.manual_seed(0)
    model = Net().double()
    reference = copy.deepcopy(model)
    shardtensor.shard_module(model, gather=gather)
    batches, last_row = _batches(world, 4), model.emb.weight.shape[0] - 1  # a row only the last rank holds
    results = []
    for net, sharded in ((model, True), (reference, False)):
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        for i, step in enumerate(batches):
            loss = _loss(net, step[dist.get_rank()]) if sharded else sum(_loss(net, b) for b in step) / world
            scaler.scale(loss).backward()
            if i == 1:  # an overflow in one row of the embedding's gradient
                grad = net.emb.weight.grad
                if not sharded:
                    grad[last_row] = float("inf")
                elif dist.get_rank() == world - 1:
                    layout = grad.shard_layout
                    grad.to_local()[last_row - layout.row_start] = float("inf")
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        results.append(((shardtensor.full_state_dict(net) if sharded else net.state_dict()), scaler.get_scale()))
    (state, scale), (ref_state, ref_scale) = results
    return scale, ref_scale, max((state[k] - v).abs().max().item() for k, v in ref_state.items())


@pytest.mark.parametrize("gather", ["overlapped", "sequential"])
def test_grad_scaler_skips_a_step_on_every_rank_together(gather):
    for scale, ref_scale, off in run_on_ranks(2, grad_scaler_case, 2, gather):
        assert scale == ref_scale == 2.0 ** 11, (scale, ref_scale)  # one skipped step halved it, on every rank
        assert off < 1e-10, off


# ---------------------------------------------------------------------------------------------- unshard
def unshard_case() -> tuple:
    torch.manual_seed(8)
    model = Net().double()
    model.head.weight = model.emb.weight if model.head.weight.shape == model.emb.weight.shape else model.head.weight
    reference = copy.deepcopy(model)
    shardtensor.shard_module(model)
    _loss(model, torch.randint(0, 11, (2, 5))).backward()
    shardtensor.unshard_module(model)
    plain = all(type(p) is nn.Parameter for p in model.parameters()) and not hasattr(model, "_shardtensor")
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values()))
    grads = all(p.grad is not None and type(p.grad) is torch.Tensor for p in model.parameters())
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = torch.equal(model(idx), reference(idx))
    resharded = shardtensor.shard_module(model)  # and it can be sharded again
    return plain, same, grads, out, isinstance(resharded.head.weight, shardtensor.ShardedParam)


def test_unshard_module_gives_plain_model():
    for result in run_on_ranks(2, unshard_case):
        assert all(result), result


def stale_optimizer_after_unshard_case() -> tuple:
    torch.manual_seed(8)
    model = shardtensor.shard_module(Net().double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(9))
    _loss(model, idx).backward()
    opt.step()
    opt.zero_grad()
    shardtensor.unshard_module(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _loss(model, idx).backward()
    with pytest.raises(RuntimeError, match="unshard_module") as refused:
        opt.step()  # it holds the old sharded parameters: it would update none of the model's
    unchanged = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    fresh.step()  # the fix the message names
    moved = any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return "new optimizer" in str(refused.value), unchanged, moved


def test_an_optimizer_of_the_sharded_parameters_after_unshard_module_is_named():
    # It was refused with "converted or replaced after shard_module ... move or convert the model before
    # shard_module", a fix that does not apply.
    for result in run_on_ranks(2, stale_optimizer_after_unshard_case):
        assert all(result), result


# ---------------------------------------------------------------------------------------------- torch.compile
def compile_case(world: int) -> tuple:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(10)
    model = Net().double()
    eager = shardtensor.shard_module(copy.deepcopy(model))
    compiled_model = shardtensor.shard_module(model)
    compiled = torch.compile(compiled_model)
    batches = _batches(world, 2, seed=11)
    result = _sharded(compiled_model, batches, compiled=compiled)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return result, _sharded(eager, batches), breaks, graphs


def test_torch_compile_same_loss_as_eager():
    for compiled, eager, breaks, graphs in run_on_ranks(2, compile_case, 2):
        _assert_same_training(compiled, eager, atol=1e-12)
        assert breaks == 0 and graphs >= 1  # ops on shards are traced (functional all-gathers): no graph break


# ---------------------------------------------------------------------------------------------- Hugging Face
def hf_case(world: int, reentrant_checkpointing: bool = False) -> tuple:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=23, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    torch.manual_seed(12)
    model = GPT2LMHeadModel(config).double()
    model.config._attn_implementation = "eager"
    assert model.lm_head.weight is model.transformer.wte.weight
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(13)
    batches = [[torch.randint(0, 23, (2, 6), generator=gen) for _ in range(world)] for _ in range(3)]

    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_losses = []
    for step in batches:
        loss = sum(reference(input_ids=b, labels=b).loss for b in step) / world
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    shardtensor.shard_module(model)
    if reentrant_checkpointing:  # each block's backward runs inside the outer one (see ckpt_case)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    tied = model.lm_head.weight is model.transformer.wte.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in batches:
        loss = model(input_ids=step[dist.get_rank()], labels=step[dist.get_rank()]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    state = shardtensor.full_state_dict(model)
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items() if v.is_floating_point())
    return losses, ref_losses, diff, tied


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.parametrize("reentrant_checkpointing", [False, True])
def test_hugging_face_gpt2_trains_like_unsharded(reentrant_checkpointing):
    for losses, ref_losses, diff, tied in run_on_ranks(2, hf_case, 2, reentrant_checkpointing):
        assert tied
        assert losses == pytest.approx(ref_losses, rel=1e-10), (losses, ref_losses)
        assert diff < 1e-10, diff


def load_into_meta_case() -> dict:
    """A meta-device model sharded and loaded without ``materialize`` (FSDP2's recipe has ``to_empty`` there)."""
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)).state_dict()
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    shardtensor.shard_module(model)
    try:
        model.load_state_dict(full)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    shardtensor.materialize(model, device="cpu")
    model.load_state_dict(full)  # the way out works
    loaded = shardtensor.full_state_dict(model)
    return {"message": message, "loaded": all(torch.equal(loaded[k], v) for k, v in full.items())}


def test_a_load_into_a_meta_model_names_materialize():
    """Helper D: torch's "Cannot copy out of meta tensor; no data!", naming no parameter and no fix."""
    for out in run_on_ranks(2, load_into_meta_case):
        assert "'0.weight' is still on the meta device" in out["message"], out
        assert "shardtensor.materialize" in out["message"] and out["loaded"], out


def to_empty_case() -> str:
    """FSDP2's recipe after meta init, ``model.to_empty(device=...)``, on a sharded model."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    shardtensor.shard_module(model)
    model.to_empty(device="cpu")
    try:
        model(torch.randn(2, 4))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_to_empty_after_meta_init_names_materialize():
    """Helper D: the message spoke of conversions before shard_module, not of to_empty or materialize."""
    for message in run_on_ranks(2, to_empty_case):
        assert "to_empty" in message and "shardtensor.materialize(model, device=...)" in message, message
