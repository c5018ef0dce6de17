"""CPUAdam: AdamW equality, exact-enough rollback, and speculation that equals the non-speculative step.

Gradients are planted with ``loss = sum(p * G)`` (so ``p.grad == G`` bit for bit) where a test needs the hooks of
a real backward; the reference is ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) on a deepcopy.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from rank_pool import run_on_ranks
from shardtensor.optim import CPUAdam
from shardtensor.optim._adam_math import Hyper, adamw_rollback_, adamw_step_

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)  # CI sees the same examples every run


def _params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _plant(params, grads):
    """Backward of sum(p * G): fires the post-accumulate hooks with p.grad == G exactly."""
    sum((p * g).sum() for p, g in zip(params, grads)).backward()


def _groups(params, hps):
    return [dict(params=[p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
            for p, (lr, b1, b2, eps, wd) in zip(params, hps)]


shape_st = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)
hp_st = st.tuples(
    st.sampled_from([1e-3, 1e-2, 3e-2]), st.sampled_from([0.0, 0.5, 0.9]), st.sampled_from([0.9, 0.99, 0.999]),
    st.sampled_from([1e-8, 1e-6]), st.sampled_from([0.0, 0.01, 0.1]),
)


# ---------------------------------------------------------------------------------------------- AdamW equality
@SETTINGS
@given(shapes=st.lists(shape_st, min_size=1, max_size=4), hps=st.data(), seed=st.integers(0, 2**16),
       speculative=st.booleans(), steps=st.integers(1, 4))
def test_equals_torch_adamw_with_groups_and_lr_schedule(shapes, hps, seed, speculative, steps):
    hyper = [hps.draw(hp_st) for _ in shapes]
    params = _params(shapes, seed)
    ref_params = [nn.Parameter(p.detach().clone()) for p in params]
    opt = CPUAdam(_groups(params, hyper), speculative=speculative)
    ref = torch.optim.AdamW(_groups(ref_params, hyper), foreach=False)
    gen = torch.Generator().manual_seed(seed + 1)
    for k in range(steps):
        for o in (opt, ref):  # an LR schedule: set before backward, as a scheduler stepped after step() does
            for grp in o.param_groups:
                grp["lr"] *= 0.7
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        if k == 1 and len(params) > 1:
            grads[0] = None  # a parameter without a gradient this step: not stepped, its step count stays
        opt.zero_grad()
        ref.zero_grad()
        live = [(p, q, g) for p, q, g in zip(params, ref_params, grads) if g is not None]
        _plant([p for p, _, _ in live], [g for _, _, g in live])
        _plant([q for _, q, _ in live], [g for _, _, g in live])
        opt.step()
        ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)
        assert int(opt.state[p]["step"]) == int(ref.state[q]["step"])
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"], atol=1e-6, rtol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], atol=1e-6, rtol=0)
    opt.close()


def test_bf16_params_step_an_fp32_master():
    torch.manual_seed(0)
    w32 = torch.randn(16, 8)
    p = nn.Parameter(w32.to(torch.bfloat16))
    ref = nn.Parameter(p.detach().float())
    opt = CPUAdam([p], lr=1e-2)
    ropt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(3):
        g = torch.randn(16, 8).to(torch.bfloat16)
        opt.zero_grad()
        ropt.zero_grad()
        _plant([p], [g])
        _plant([ref], [g.float()])
        opt.step()
        ropt.step()
    assert p.dtype == torch.bfloat16 and opt.state[p]["master"].dtype == torch.float32
    torch.testing.assert_close(opt.state[p]["master"], ref.detach(), atol=1e-6, rtol=0)
    assert torch.equal(p.detach(), ref.detach().to(torch.bfloat16))  # the write-back is a plain rounding
    opt.close()


# ---------------------------------------------------------------------------------------------- rollback
def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of float32 spacing at max(|a|, |b|)."""
    scale = torch.maximum(a.abs(), b.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    return (a - b).abs() / (torch.finfo(torch.float32).eps * scale)


@SETTINGS
@given(shape=shape_st, hp=hp_st, seed=st.integers(0, 2**16), warm=st.integers(0, 4),
       grad_scale=st.sampled_from([0.1, 1.0, 10.0]))
def test_rollback_of_step_restores_params_and_moments(shape, hp, seed, warm, grad_scale):
    lr, b1, b2, eps, wd = hp
    (p,) = _params([shape], seed)
    opt = CPUAdam(_groups([p], [hp]), speculative=False)
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(warm):
        p.grad = torch.randn(shape, generator=gen)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()} if warm else None
    p0 = p.detach().clone()
    p.grad = grad_scale * torch.randn(shape, generator=gen)
    opt.step()
    assert not torch.equal(p.detach(), p0)
    opt.rollback()
    assert int(opt.state[p]["step"]) == warm  # step counts exact
    # Two roundings of p plus the update recomputed from rolled-back moments: seen up to 4.6 ulps (a sum that
    # crosses a power of two doubles the spacing), so the bound is 8.
    assert _ulps(p.detach(), p0).max() <= 8
    if warm == 0:  # back to step 0: moments are exact zeros again
        assert not opt.state[p]["exp_avg"].any() and not opt.state[p]["exp_avg_sq"].any()
        return
    # m and v: a few ulps of the largest term the inversion cancels (m ~ (1-b1) g, v ~ (1-b2) g^2).
    g = p.grad.abs()
    if b1 == 0.0:  # m_prev is not recoverable from m = g (and no later step reads it)
        before["exp_avg"] = torch.zeros_like(g)
    m_tol = 4 * torch.finfo(torch.float32).eps * (before["exp_avg"].abs() + g)
    v_tol = 4 * torch.finfo(torch.float32).eps * (before["exp_avg_sq"] + g * g)
    assert ((opt.state[p]["exp_avg"] - before["exp_avg"]).abs() <= m_tol).all()
    assert ((opt.state[p]["exp_avg_sq"] - before["exp_avg_sq"]).abs() <= v_tol).all()
    assert (opt.state[p]["exp_avg_sq"] >= 0).all()


def test_repeated_step_rollback_cycles_do_not_drift():
    torch.manual_seed(0)
    n, cycles = 4096, 200
    p, m, v = torch.randn(n), 0.01 * torch.randn(n), 1e-4 * torch.rand(n)
    step = torch.tensor(7.0)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    hp = Hyper(1e-2, 0.9, 0.999, 1e-8, 0.1)
    # ulps of p at the scale of p or of the update (lr), whichever is larger: rounding of either lands there
    unit = torch.finfo(torch.float32).eps * torch.maximum(p0.abs(), torch.tensor(hp.lr))
    rms = {}
    for c in range(1, cycles + 1):
        g = 0.01 * torch.randn(n)
        step += 1
        adamw_step_([p], [g], [m], [v], [step], hp)
        adamw_rollback_([p], [g], [m], [v], [step], hp)
        err = (p - p0) / unit
        rms[c] = err.pow(2).mean().sqrt().item()
    assert step.item() == 7.0  # step counts exact
    # No drift: the signed error averages to ~0 (rounding of either sign), and its spread grows like a random
    # walk (sqrt(cycles)), not linearly; every element stays within a few ulps * sqrt(cycles).
    assert abs(err.mean().item()) < 0.1, err.mean()
    assert rms[cycles] <= 2.0 * math.sqrt(cycles) * rms[1], rms
    assert err.abs().max().item() <= 4 * math.sqrt(cycles), err.abs().max()
    torch.testing.assert_close(m, m0, atol=1e-8, rtol=1e-4)
    torch.testing.assert_close(v, v0, atol=1e-10, rtol=1e-4)


def test_rollback_error_is_a_few_ulps():
    """Measures (and prints) the inversion error of one step on realistic state; the report quotes it."""
    torch.manual_seed(1)
    n = 1 << 16
    p, m, v = torch.randn(n), 0.01 * torch.randn(n), 1e-4 * torch.rand(n)
    g = 0.01 * torch.randn(n)
    step = torch.tensor(11.0)
    hp = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    adamw_step_([p], [g], [m], [v], [step], hp)
    adamw_rollback_([p], [g], [m], [v], [step], hp)
    exact = {k: (a == b).float().mean().item() for k, a, b in (("p", p, p0), ("m", m, m0), ("v", v, v0))}
    # Error in ulps of the largest term each inversion cancels: p against lr-sized updates, m against
    # (1-b1)|g|, v against (1-b2) g^2.  Relative to a tiny m_prev the error can be large (see [Note: rollback error]).
    eps32 = torch.finfo(torch.float32).eps
    units = {
        "p": eps32 * torch.maximum(p0.abs(), torch.tensor(hp.lr)),
        "m": eps32 * torch.maximum(m0.abs(), (1 - hp.beta1) * g.abs()),
        "v": eps32 * torch.maximum(v0, (1 - hp.beta2) * g * g),
    }
    worst = {k: ((a - b).abs() / units[k]).max().item() for k, a, b in (("p", p, p0), ("m", m, m0), ("v", v, v0))}
    rel_m = ((m - m0).abs() / m0.abs()).max().item()
    figures = f"rollback: bit-exact fraction {exact}; worst error in ulps of the cancelled term {worst}; " \
              f"worst relative error of m {rel_m:.2e}"  # shown only when an assertion below fails
    assert exact["p"] > 0.95 and exact["v"] > 0.9 and exact["m"] > 0.5, figures
    assert max(worst.values()) <= 4, figures


def test_rollback_gives_back_exact_zero_moments_where_no_earlier_gradient_reached():
    """Embedding rows no earlier batch used: m0 = v0 = 0.  The inverse recovers v0 = 0 exactly but m0 only within
    ulps of (1 - b1)|g|, and m != 0 beside v = 0 would move the row by lr * m / eps at the next step (see
    [Note: a zero second moment]): those moments must come back as exact zeros."""
    gen = torch.Generator().manual_seed(3)
    n = 4096
    p, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    step = torch.tensor(0.0)
    hp = Hyper(1e-3, 0.9, 0.999, 1e-8, 0.01)
    unused = torch.rand(n, generator=gen) < 0.5
    for k in range(2):
        g = 0.01 * torch.randn(n, generator=gen)
        if k == 0:
            g[unused] = 0.0  # rows this first batch did not reach
        step += 1
        adamw_step_([p], [g], [m], [v], [step], hp)
        if k == 0:  # AdamW left them exactly zero
            assert torch.equal(m[unused], torch.zeros(int(unused.sum()))) and torch.equal(v[unused], m[unused])
    adamw_rollback_([p], [g], [m], [v], [step], hp)  # undo the second step
    m0, v0 = m.clone(), v.clone()
    assert torch.equal(v0[unused], torch.zeros(int(unused.sum())))
    assert torch.equal(m0[unused], torch.zeros(int(unused.sum())))
    assert (m0[~unused] != 0).all()  # the rule touches only the zero-v elements


def test_rollback_refuses_when_gradients_changed():
    (p,) = _params([(5,)], 0)
    opt = CPUAdam([p], speculative=False)
    p.grad = torch.randn(5)
    opt.step()
    p.grad.add_(1.0)  # e.g. the next backward accumulated into it
    with pytest.raises(RuntimeError, match="changed since step"):
        opt.rollback()
    opt.zero_grad()
    with pytest.raises(RuntimeError, match="no step to undo"):
        opt.rollback()


# ---------------------------------------------------------------------------------------------- speculation
class _Run:
    """One model + optimizer; ``train`` plants gradients through backward and steps."""

    def __init__(self, params, **kw):
        self.params = params
        self.opt = CPUAdam(params, **kw)

    def backward(self, grads, inf_at=None):
        grads = list(grads)
        if inf_at is not None:
            grads[inf_at] = grads[inf_at].clone()
            grads[inf_at].view(-1)[0] = math.inf
        _plant(self.params, grads)


def _grad_seq(shapes, steps, seed, scales):
    gen = torch.Generator().manual_seed(seed)
    return [[s * torch.randn(sh, generator=gen) for sh in shapes] for s in scales[:steps]]


def test_speculative_equals_reference_under_clipping_inf_and_pausing():
    shapes = [(8, 4), (4,), (3, 3)]
    scales = [1.0, 3.0, 0.2, 1.0, 5.0, 5.0, 5.0, 5.0, 0.3, 1.0]  # clip, skip (inf), streak of clips, recovery
    inf_step = 3
    seq = _grad_seq(shapes, len(scales), 0, scales)
    spec = _Run(_params(shapes, 1), lr=1e-2, max_grad_norm=10.0, speculative=True, clip_patience=2)
    ref_params = _params(shapes, 1)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.01)
    for k, grads in enumerate(seq):
        spec.opt.zero_grad()
        spec.backward(grads, inf_at=1 if k == inf_step else None)
        spec.opt.step()
        if k != inf_step:  # the reference skips the inf step by hand
            for q, g in zip(ref_params, grads):
                q.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(ref_params, 10.0)
            ref.step()
    for p, q in zip(spec.params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)
    s = spec.opt.stats
    assert s.skipped_steps == 1 and s.clipped_steps >= 3
    assert s.rolled_back_steps >= 1 and s.committed_steps >= 3
    assert s.paused_steps >= 1  # two clipped steps in a row paused speculation
    spec.opt.close()


def test_inf_gradient_is_never_stepped_and_stops_speculation():
    shapes = [(6,), (6,), (6,)]
    run = _Run(_params(shapes, 0), lr=1e-1, speculative=True)
    before = [p.detach().clone() for p in run.params]
    run.backward(_grad_seq(shapes, 1, 3, [1.0])[0], inf_at=2)  # hooks fire in reverse order: param 2 first
    run.opt._drain()
    assert all(not run.opt._slot(p).spec_hp for p in run.params)  # nothing stepped after the inf
    run.opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(run.params, before))
    assert all(int(run.opt.state[p]["step"]) == 0 for p in run.params)
    assert all(torch.isfinite(run.opt.state[p]["exp_avg"]).all() for p in run.params)
    assert run.opt.stats.skipped_steps == 1
    run.opt.close()


@pytest.mark.parametrize("use_knob", [False, True])
def test_gradient_accumulation_equals_one_large_batch(use_knob):
    shapes = [(5, 3), (3,)]
    micro = 3
    spec = _Run(_params(shapes, 0), lr=1e-2, speculative=True)
    plain = _Run(_params(shapes, 0), lr=1e-2, speculative=False)
    for k in range(4):
        parts = _grad_seq(shapes, micro, 10 + k, [1.0] * micro)
        for run in (spec, plain):
            run.opt.zero_grad()
            for i, grads in enumerate(parts):
                if use_knob and run is spec and i < micro - 1:
                    with run.opt.accumulating():
                        run.backward(grads)
                else:
                    run.backward(grads)
            run.opt.step()
    for p, q in zip(spec.params, plain.params):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)
    s = spec.opt.stats
    if use_knob:  # declared micro-batches: every step speculates on the final gradient, nothing rolls back
        assert s.rolled_back_steps == 0 and s.committed_steps == 4
    else:  # the first step learns 3 hooks per step (rolling back), later steps speculate on the 3rd hook
        assert s.rolled_back_steps == 1 and s.committed_steps == 3
    spec.opt.close()


def test_lr_changed_after_backward_redoes_the_speculation():
    shapes = [(4, 4)]
    spec = _Run(_params(shapes, 0), lr=1e-2, speculative=True)
    plain = _Run(_params(shapes, 0), lr=1e-2, speculative=False)
    for k, grads in enumerate(_grad_seq(shapes, 3, 5, [1.0] * 3)):
        for run in (spec, plain):
            run.opt.zero_grad()
            run.backward(grads)
            run.opt.param_groups[0]["lr"] = 1e-2 / (k + 2)  # changed after the hook queued the step
            run.opt.step()
    torch.testing.assert_close(spec.params[0].detach(), plain.params[0].detach(), atol=1e-6, rtol=0)
    assert spec.opt.stats.rolled_back_steps == 3
    spec.opt.close()


def test_zero_grad_without_step_undoes_speculation():
    shapes = [(4,), (2, 2)]
    run = _Run(_params(shapes, 0), lr=1e-1, speculative=True)
    masters = [run.opt._slot(p).master().clone() for p in run.params]
    run.backward(_grad_seq(shapes, 1, 0, [1.0])[0])
    run.opt.zero_grad()  # the user decided not to step
    for p, m in zip(run.params, masters):
        torch.testing.assert_close(run.opt._slot(p).master(), m, atol=1e-7, rtol=0)
        assert int(run.opt.state[p]["step"]) == 0
    run.opt.close()


# ---------------------------------------------------------------------------------------------- two ranks
def _two_rank_case(sharded: bool, seed: int) -> list:
    """Speculative vs non-speculative CPUAdam on the same data, clipping + a rank-local inf; returns max diff."""
    from shardtensor import _comm
    from shardtensor.optim import CPUAdam

    rank = _comm.rank()

    def build():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))
        if sharded:
            from shardtensor import shard_module

            shard_module(model, gather="sequential")
        else:  # replicated: average grads in a pre-accumulate hook, as DDP would, before the optimizer hooks
            for p in model.parameters():
                p.register_hook(lambda g: _avg(g))
        return model

    def _avg(g):
        g = g.detach().clone()
        _comm.all_reduce(g, op="avg")
        return g

    inf_step = 2
    runs = []
    for speculative in (True, False):
        model = build()
        params = list(model.parameters())
        # Rank 1 alone sees an inf on one gradient at inf_step: the flag must reach rank 0 too.  Registered before
        # the optimizer's hooks, so it runs first.
        state = {"k": 0}

        def poison(p, state=state):
            if rank == 1 and state["k"] == inf_step:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                g.view(-1)[0] = math.inf

        params[0].register_post_accumulate_grad_hook(poison)
        opt = CPUAdam([{"params": params[:2], "lr": 2e-2}, {"params": params[2:], "lr": 1e-2, "weight_decay": 0.1}],
                      max_grad_norm=0.6, speculative=speculative)
        gen = torch.Generator().manual_seed(100 + rank)
        for k in range(6):
            state["k"] = k
            x = torch.randn(8, 6, generator=gen) * (3.0 if k in (1, 4) else 0.5)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        runs.append((params, opt))
    (sp, so), (pp, po) = runs
    local = (lambda t: t.to_local()) if sharded else (lambda t: t)
    diff = max((local(a.detach()) - local(b.detach())).abs().max().item() for a, b in zip(sp, pp))
    out = dict(diff=diff, stats=so.stats.__dict__, ref_stats=po.stats.__dict__, sharded=[hasattr(p, "to_local") for p in sp],
               first=local(sp[0].detach()).flatten()[:4].tolist())
    so.close()
    po.close()
    return out


@pytest.mark.parametrize("sharded", [False, True])
def test_two_ranks_speculative_equals_non_speculative(sharded):
    if sharded:
        pytest.importorskip("shardtensor.tensor")
    results = run_on_ranks(2, _two_rank_case, sharded, 0)
    for r in results:
        assert r["diff"] <= 1e-6, r
        assert r["stats"]["skipped_steps"] == 1 and r["ref_stats"]["skipped_steps"] == 1, r
        assert r["stats"]["clipped_steps"] >= 1 and r["stats"]["speculated_steps"] >= 3, r
        assert r["stats"]["clipped_steps"] == r["ref_stats"]["clipped_steps"], r
        assert all(r["sharded"]) == sharded, r
    if sharded:
        assert results[0]["first"] != results[1]["first"]  # each rank holds different rows
    else:
        assert results[0]["first"] == results[1]["first"]  # replicated parameters stay identical


# ---------------------------------------------------------------------------------------------- structure
def test_speculation_phases_are_asserted_and_a_state_store_is_the_seam():
    """A hook that fires while step() validates is a named error (not a silent race); a custom StateStore gets the
    moments, every batched step runs through its chunks, and the results equal the default store's bit for bit."""
    from shardtensor.optim._speculation import SpecPhase
    from shardtensor.optim.state_store import HostStore, StateStore

    class Counting(HostStore):
        def __init__(self):
            super().__init__()
            self.tracked, self.chunked = [], 0

        def track(self, key, state):
            self.tracked.append(key)

        def chunks(self, keys):
            self.chunked += 1
            for k in keys:  # one parameter per chunk: the optimizer must not assume one chunk
                yield [k]

    shapes = [(4, 3), (3,)]
    store = Counting()
    assert isinstance(store, StateStore)
    runs = [_Run(_params(shapes, 0), lr=1e-2, max_grad_norm=1.0, state_store=s) for s in (store, None)]
    for grads in _grad_seq(shapes, 3, 0, [0.1, 5.0, 0.1]):  # the middle step clips: rollback through chunks too
        for run in runs:
            run.opt.zero_grad()
            run.backward(grads)
            run.opt.step()
    assert all(torch.equal(p, q) for p, q in zip(runs[0].params, runs[1].params))
    assert sorted(store.tracked) == [0, 1] and store.chunked >= 1  # the clipped step's redo
    before = store.chunked
    runs[0].opt.rollback()  # the inverse runs through the chunks too
    assert store.chunked == before + 1
    opt = runs[0].opt
    assert opt._phase is SpecPhase.IDLE
    opt._phase = SpecPhase.VALIDATING  # as if a backward ran inside step()
    with pytest.raises(AssertionError, match="expected phase.*validating"):
        runs[0].backward(_grad_seq(shapes, 1, 1, [1.0])[0])
    opt._phase = SpecPhase.IDLE
    for run in runs:
        run.opt.close()


class _ScaleAndValueHead(nn.Module):
    """A replicated 0-d parameter (its gradient a plain tensor in ``clip_grad_norm_``'s list) and a one-row
    weight (each rank's padded shard has the full tensor's shape)."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.value = nn.Linear(width, 1)

    def forward(self, h):
        return h * (self.scale + self.value(h))  # a product: a value added to every logit has no gradient


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _user_clip_case(gather: str) -> dict:
    """The README's loop with CPUAdam: ``clip_grad_norm_`` by hand after backward, then ``opt.step()``.  The
    speculative steps taken during backward used the unclipped gradients; the clip must be seen and the steps
    redone, the replicated 0-d parameter's too.  Reference: the same sharded model under torch's AdamW."""
    from shardtensor import shard_module
    from shardtensor.optim import CPUAdam

    runs = []
    for make_opt in (lambda ps: CPUAdam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 32),
                              _ScaleAndValueHead(32))
        shard_module(model, gather=gather)
        opt = make_opt(list(model.parameters()))
        gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        norms = []
        for _ in range(4):
            x = torch.randint(0, 32, (8,), generator=gen)
            nn.functional.cross_entropy(model(x), x).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            opt.step()
            opt.zero_grad()
        runs.append(([_local_of(p.detach()).clone() for p in model.parameters()], norms, opt))
    (mine, norms, opt), (ref, _, _) = runs
    out = dict(diff=max((a - b).abs().max().item() for a, b in zip(mine, ref)), norms=norms,
               speculated=opt.stats.speculated_params)
    opt.close()
    return out


@pytest.mark.parametrize("gather", ["sequential", "overlapped"])
def test_speculative_steps_see_a_clip_grad_norm_done_by_hand(gather):
    for r in run_on_ranks(2, _user_clip_case, gather):
        assert min(r["norms"]) > 0.5, r  # every step clipped (0.05): the unclipped steps would differ
        assert r["speculated"] > 0, r
        assert r["diff"] <= 1e-6, r


def _grad_scaler_case(gather: str) -> dict:
    """``torch.amp.GradScaler`` (default scale 65536) around speculative CPUAdam for three steps, then three steps
    without it; reference: torch's AdamW on the same sharded model under the same loop."""
    from shardtensor import shard_module
    from shardtensor.optim import CPUAdam

    runs = []
    for make_opt in (lambda ps: CPUAdam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)):
        torch.manual_seed(0)
        model = shard_module(nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 32)),
                             gather=gather)
        opt = make_opt(list(model.parameters()))
        scaler = torch.amp.GradScaler("cpu")
        gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        speculated = []
        for step in range(6):
            x = torch.randint(0, 32, (8,), generator=gen)
            loss = nn.functional.cross_entropy(model(x), x)
            if step < 3:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
            speculated.append(getattr(getattr(opt, "stats", None), "speculated_steps", 0))
        runs.append(([_local_of(p.detach()).clone() for p in model.parameters()], speculated, opt))
    (mine, speculated, opt), (ref, _, _) = runs
    opt.close()
    return dict(diff=max((a - b).abs().max().item() for a, b in zip(mine, ref)), speculated=speculated)


@pytest.mark.parametrize("gather", ["sequential", "overlapped"])
def test_speculative_steps_under_a_grad_scaler_equal_torchs_adamw(gather):
    # The speculative steps ran on the scaled gradients; GradScaler's unscale rewrote them and every step was
    # undone, which loses the moments of a step taken on a 65536x gradient: 0.69 off torch's AdamW after 3 steps.
    for r in run_on_ranks(2, _grad_scaler_case, gather):
        assert r["diff"] <= 1e-5, r
        scaled, plain = r["speculated"][:3], r["speculated"][3:]
        assert scaled == [1, 1, 1], r  # the first step speculated; rewritten gradients paused it
        assert plain[-1] > plain[0], r  # gradients no longer rewritten: speculation resumed


def _local_versions_case() -> list:
    from shardtensor import shard_module

    model = shard_module(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2), _ScaleAndValueHead(2)))
    model(torch.randn(3, 4)).sum().backward()
    grads = [p.grad for p in model.parameters()]
    plain = model[2].scale.grad  # replicated: a plain tensor beside the shards in a foreach list
    seen = []
    for write, writes_plain in ((lambda: grads[0].mul_(0.5), False), (lambda: torch._foreach_mul_(grads, 0.5), True),
                                (lambda: grads[0].copy_(grads[0] * 2), False),
                                (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3), True)):
        before, plain_before = grads[0].to_local()._version, plain._version
        write()
        seen.append(grads[0].to_local()._version > before)
        if writes_plain:
            seen.append(plain._version > plain_before)
    return seen


def test_a_write_through_a_sharded_tensor_bumps_its_local_version():
    """What CPUAdam's snapshot check reads (see [Note: writes through the wrapper are versioned on the shard])."""
    for seen in run_on_ranks(2, _local_versions_case):
        assert all(seen), seen


def _units_speculation_case() -> dict:
    """Default (overlapped) mode: every block is a gather unit, whose gradients land after AccumulateGrad.  The
    speculative steps must run on the landed gradients (see [Note: gradient hooks run when the gradient lands]),
    so they stand, and the result is torch's AdamW on the same sharded model."""
    from shardtensor import shard_module
    from shardtensor.optim import CPUAdam

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.tanh(self.fc(x))

    runs = []
    for make_opt in (lambda ps: CPUAdam(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 32))
        shard_module(model)
        blocks = model[1]
        opt = make_opt(list(model.parameters()))
        gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
        for _ in range(4):
            x = torch.randint(0, 32, (8,), generator=gen)
            h = model[0](x)
            for block in blocks:
                h = block(h)
            nn.functional.cross_entropy(model[2](h), x).backward()
            opt.step()
            opt.zero_grad()
        runs.append(([p.detach().to_local().clone() for p in model.parameters()], opt))
    (mine, opt), (ref, _) = runs
    out = dict(diff=max((a - b).abs().max().item() for a, b in zip(mine, ref)), stats=vars(opt.stats).copy())
    opt.close()
    return out


def test_speculative_steps_of_unit_parameters_stand():
    for r in run_on_ranks(2, _units_speculation_case):
        stats = r["stats"]
        assert stats["speculated_params"] > 0 and stats["rolled_back_params"] == 0, stats
        assert stats["committed_steps"] == stats["steps"] == 4, stats
        assert r["diff"] <= 1e-6, r


def test_a_cpu_adam_replaced_through_its_state_dict_no_longer_moves_that_state():
    # A speculative CPUAdam whose state is loaded into another optimizer, and which is dropped without close():
    # its hooks kept it alive and its worker kept stepping the live moments it had handed out (0.02 off AdamW).
    import gc

    torch.manual_seed(0)
    build = lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))  # noqa: E731
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen)) for _ in range(6)]
    torch.manual_seed(0)
    reference = build()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.05)
    torch.manual_seed(0)
    model = build()
    opt = CPUAdam(model.parameters(), lr=0.05, speculative=True)
    for i, (x, y) in enumerate(data):
        if i == 3:
            state = opt.state_dict()
            del opt
            gc.collect()
            opt = torch.optim.AdamW(model.parameters(), lr=0.05)
            opt.load_state_dict(state)
        for m, o in ((model, opt), (reference, ref_opt)):
            ((m(x) - y) ** 2).mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nvme", [False, True])
def test_a_load_torch_refuses_leaves_the_optimizer_stepping_as_before(nvme, tmp_path):
    # NVMeCPUAdam's store was reset before torch's checks refused the state dict: the next step died with a
    # bare KeyError from the swap planner.
    from shardtensor.offload import NVMeCPUAdam, NVMeOffload

    def run(refused_load: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 3))
        opt = (NVMeCPUAdam(model.parameters(), NVMeOffload(str(tmp_path / f"swap{int(refused_load)}")), lr=0.01,
                           speculative=False) if nvme else CPUAdam(model.parameters(), lr=0.01, speculative=False))
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            ((model(torch.randn(5, 16, generator=gen)) - torch.randn(5, 3, generator=gen)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0 and refused_load:
                state = opt.state_dict()
                group = {**state["param_groups"][0], "params": state["param_groups"][0]["params"][:-1]}
                with pytest.raises(ValueError, match="size"):
                    opt.load_state_dict({**state, "param_groups": [group]})
        return [p.detach().clone() for p in model.parameters()]

    for p, q in zip(run(True), run(False)):
        assert torch.equal(p, q)


@pytest.mark.parametrize("variant", [{"maximize": True}, {"amsgrad": True},
                                     {"decoupled_weight_decay": False, "weight_decay": 0.1}])
def test_adam_variants_cpu_adam_does_not_implement_are_refused_not_stepped_as_adamw(variant):
    # A param group asking for them (or a torch Adam/AdamW state dict holding them) was stepped as plain AdamW.
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=next(iter(variant))):
        CPUAdam([{"params": model.parameters(), **variant}], speculative=False)
    opt = CPUAdam(model.parameters(), lr=0.01, speculative=False)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = opt.state_dict()
    torch_adam = torch.optim.Adam(model.parameters(), lr=0.01, **variant)
    torch_adam.step()
    with pytest.raises(ValueError, match=next(iter(variant))):
        opt.load_state_dict(torch_adam.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, state in before["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][i][key], value), key
    fine = torch.optim.AdamW(model.parameters(), lr=0.01)  # the variant it implements still loads
    fine.step()
    opt.load_state_dict(fine.state_dict())


def test_a_speculative_cpu_adam_dropped_for_a_new_one_is_collected_and_steps_no_more():
    # An optimizer replaced without close() (an LR finder's, then the real run's): its gradient hooks held it, so
    # every backward after snapshotted each gradient and stepped a second, unused copy of the state on the CPU.
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    finder = CPUAdam(model.parameters(), lr=0.05, speculative=True)
    model(torch.randn(5, 6)).square().mean().backward()
    finder.step()
    finder.zero_grad()
    dropped = weakref.ref(finder)
    finder = CPUAdam(model.parameters(), lr=0.05, speculative=True)
    gc.collect()
    assert dropped() is None, "the dropped optimizer is still alive"
    assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in model.parameters())  # the new one's
    model(torch.randn(5, 6)).square().mean().backward()
    finder.step()
    assert finder.stats.speculated_params == len(list(model.parameters()))


class _ScaledRegressor(nn.Module):
    """A learnable 0-d temperature beside sharded layers (kept whole on every rank, averaged like DDP's)."""

    def __init__(self):
        super().__init__()
        self.a, self.v = nn.Linear(4, 6), nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x, y):
        return ((self.v(torch.tanh(self.a(x))).mean(-1) * self.scale) - y).pow(2).mean()


def _replicated_beside_sharded_case(persist_numel: int) -> dict:
    import shardtensor

    runs = []
    for speculative in (True, False):
        torch.manual_seed(0)
        model = shardtensor.shard_module(_ScaledRegressor().double(), persist_numel=persist_numel)
        opt = CPUAdam(model.parameters(), lr=1e-2, speculative=speculative)
        gen = torch.Generator().manual_seed(3 + torch.distributed.get_rank())
        for _ in range(4):
            model(torch.randn(4, 4, generator=gen, dtype=torch.float64),
                  torch.randn(4, generator=gen, dtype=torch.float64)).backward()
            opt.step()
            opt.zero_grad()
        runs.append((shardtensor.full_state_dict(model), dict(opt.stats.__dict__)))
        opt.close()
    (spec, stats), (plain, _) = runs
    return {"stats": stats, "off": max((spec[k] - plain[k]).abs().max().item() for k in plain)}


# The end of backward wrote each replicated gradient again after a hook had averaged it (the same values): the
# version bump read as gradients rewritten after their hooks, and speculation paused for the whole model.
@pytest.mark.parametrize("persist_numel", [0, 8])
def test_replicated_parameters_leave_speculation_running(persist_numel):
    for r in run_on_ranks(2, _replicated_beside_sharded_case, persist_numel):
        assert r["stats"]["paused_steps"] == 0 and r["stats"]["committed_steps"] == 4, r
        assert r["off"] < 1e-12, r
