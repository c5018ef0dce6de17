"""The checked AdamW kernel (``ops/_adamw_cpu``): torch's fused arithmetic bit for bit, inf/NaN elements untouched,
and CPUAdam's skip through it (step, then undo) equal to the skip without it.
"""

from __future__ import annotations

import math
import shutil
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtensor.ops import _adamw_cpu
from shardtensor.ops._adamw_cpu import adamw_checked_, adamw_checked_ref_, adamw_cpu_kernel_status
from shardtensor.optim import CPUAdam

KERNEL = adamw_cpu_kernel_status() == "ok"
needs_kernel = pytest.mark.skipif(not KERNEL, reason=f"checked AdamW kernel: {adamw_cpu_kernel_status()}")


def test_kernel_is_built_wherever_it_can_be():
    """CI's machine (Linux, AVX2, gcc) must run the kernel, not silently the slower fallback."""
    can = (sys.platform.startswith("linux") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
           and shutil.which("cc") is not None)
    assert KERNEL or not can, adamw_cpu_kernel_status()


# numel drawn around the 8-lane body / scalar tail split and the 16-element thread boundaries; a list whose total
# passes 65536 elements runs on several OpenMP threads, split inside tensors.
numel_st = st.one_of(st.integers(1, 40), st.integers(60_000, 70_000))
hyper_st = st.fixed_dictionaries(dict(
    lr=st.sampled_from([1e-4, 1e-3, 3e-2]), beta1=st.sampled_from([0.0, 0.5, 0.6, 0.9]),
    beta2=st.sampled_from([0.0, 0.9, 0.999]), eps=st.sampled_from([1e-8, 1e-6]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1])))


@needs_kernel
@settings(max_examples=40)
@given(numels=st.lists(numel_st, min_size=1, max_size=4), hp=hyper_st, t=st.integers(1, 2000),
       bad=st.lists(st.tuples(st.integers(0, 3), st.floats(0, 1), st.sampled_from([math.inf, -math.inf, math.nan])),
                    max_size=4),
       seed=st.integers(0, 2**16), threads=st.sampled_from([1, 2]))
def test_checked_step_equals_torch_fused_where_finite_and_leaves_inf_nan_elements(numels, hp, t, bad, seed,
                                                                                    threads):
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen) for n in numels]
    g = [0.01 * torch.randn(n, generator=gen) for n in numels]
    m = [0.01 * torch.randn(n, generator=gen) for n in numels]
    v = [1e-4 * torch.rand(n, generator=gen) for n in numels]
    for k, where, value in bad:
        if k < len(numels):
            g[k][int(where * (numels[k] - 1))] = value
    steps = [torch.tensor(float(t)) for _ in numels]
    mine, ref = ([x.clone() for x in p + m + v] for _ in range(2))
    n = len(numels)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        counts = adamw_checked_(mine[:n], g, mine[n:2 * n], mine[2 * n:], steps, **hp)
    finally:
        torch.set_num_threads(before)
    ref_counts = adamw_checked_ref_(ref[:n], g, ref[n:2 * n], ref[2 * n:], steps, **hp)
    assert counts == ref_counts == [int((~torch.isfinite(x)).sum()) for x in g]
    for a, b in zip(mine, ref):  # the reference is torch's own fused step, masked: bit for bit
        assert torch.equal(a, b), (a - b).abs().max()
    for k in range(n):  # inf/NaN elements: p, m, v exactly as they were
        hit = ~torch.isfinite(g[k])
        for after, orig in ((mine[k], p[k]), (mine[n + k], m[k]), (mine[2 * n + k], v[k])):
            assert torch.equal(after[hit], orig[hit])


def _train(params, grads_per_step, **kw):
    """Non-speculative CPUAdam over planted gradients; (p, m, v) of every parameter after every step."""
    opt = CPUAdam(params, lr=1e-2, speculative=False, **kw)
    history = []
    for grads in grads_per_step:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        history.append([(p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                        for p in params])
    return opt, history


@pytest.mark.parametrize("inf_step", [0, 2])  # step 1 (moments back to exact zeros) and a later one
def test_skipped_step_through_the_kernel_equals_the_skip_without_it(monkeypatch, inf_step):
    """A step with a NaN: the kernel path steps the finite elements, learns the verdict and undoes them; the
    fallback path checks first and steps nothing.  Both skip (counters, step counts), and the runs agree."""
    shapes = [(33, 5), (7,), (70_000,)]
    gen = torch.Generator().manual_seed(0)
    grads = [[0.01 * torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    grads[inf_step][1][3] = math.nan
    eps32 = torch.finfo(torch.float32).eps
    finals = {}
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr(_adamw_cpu, "_status", "off: test")
            monkeypatch.setattr(_adamw_cpu, "_kernel", None)
        elif not KERNEL:
            continue
        gen = torch.Generator().manual_seed(1)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        start = [(p.detach().clone(), torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        opt, history = _train(params, grads)
        assert opt.stats.skipped_steps == 1
        assert all(int(opt.state[p]["step"]) == 4 for p in params)
        before = history[inf_step - 1] if inf_step else start
        for (p1, m1, v1), (p0, m0, v0) in zip(history[inf_step], before):
            # undone within the rollback's few ulps (at the scale of p or of an lr-sized update); exact without
            # the kernel; at step 1 the moments return to AdamW's exact zeros
            assert ((p1 - p0).abs() <= 4 * eps32 * torch.maximum(p0.abs(), torch.tensor(1e-2))).all()
            if inf_step == 0 or not kernel:
                assert torch.equal(m1, m0) and torch.equal(v1, v0)
            else:
                torch.testing.assert_close(m1, m0, atol=1e-8, rtol=1e-4)
                torch.testing.assert_close(v1, v0, atol=1e-10, rtol=1e-4)
            if not kernel:
                assert torch.equal(p1, p0)
        nan_p = history[inf_step][1][0][3]
        assert torch.equal(nan_p, before[1][0][3])  # the NaN element itself was never touched
        finals[kernel] = history[-1]
    if True in finals:
        for (pa, ma, va), (pb, mb, vb) in zip(finals[True], finals[False]):
            torch.testing.assert_close(pa, pb, atol=1e-6, rtol=0)


@needs_kernel
def test_checked_step_is_what_cpu_adam_runs_by_default(monkeypatch):
    """Without clipping, CPUAdam's default step goes through the kernel (no separate read of the gradient);
    with clipping the check rides on the norm's read and the step is torch's fused one."""
    calls = []
    real = _adamw_cpu.adamw_checked_
    monkeypatch.setattr("shardtensor.optim._batched.adamw_checked_",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for clip, expect_calls in ((None, True), (1.0, False)):
        calls.clear()
        p = torch.nn.Parameter(torch.randn(100))
        opt = CPUAdam([p], max_grad_norm=clip)
        p.grad = torch.randn(100)
        opt.step()
        assert bool(calls) == expect_calls and opt.stats.skipped_steps == 0


@pytest.mark.parametrize("inf_step", [0, 3])
def test_speculative_checked_steps_skip_an_inf_step_like_torch_skipping_it(inf_step):
    """Speculation without clipping runs the checked kernel on the worker during backward: an inf in the first
    gradient to arrive halts it after undoing that gradient's finite elements (on the speculative copy, never the
    parameter), and the run equals torch's AdamW that skips that step by hand."""
    shapes = [(40, 3), (9,), (5, 5)]
    gen = torch.Generator().manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = CPUAdam(params, lr=1e-2, speculative=True)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01)
    for k in range(6):
        grads = [0.1 * torch.randn(s, generator=gen) for s in shapes]
        if k == inf_step:
            grads[-1] = grads[-1].clone()
            grads[-1][2, 1] = math.inf  # hooks fire in reverse order: the last parameter's gradient comes first
        opt.zero_grad()
        sum((p * g).sum() for p, g in zip(params, grads)).backward()  # p.grad == g exactly, hooks fire
        opt.step()
        if k != inf_step:
            for q, g in zip(ref, grads):
                q.grad = g.clone()
            ref_opt.step()
    for p, q in zip(params, ref):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=0)
        torch.testing.assert_close(opt.state[p]["exp_avg"], ref_opt.state[q]["exp_avg"], atol=1e-6, rtol=0)
    assert opt.stats.skipped_steps == 1 and opt.stats.speculated_steps >= 4
    opt.close()


def test_mismatched_lengths_are_refused_before_the_kernel_reads_past_an_end():
    p, m, v = torch.zeros(16), torch.zeros(16), torch.zeros(16)
    with pytest.raises(ValueError, match=r"tensor #0 has p.numel\(\)=16 g.numel\(\)=8"):
        adamw_checked_([p], [torch.zeros(8)], [m], [v], [torch.tensor(1.0)], lr=1e-3, beta1=0.9, beta2=0.999,
                       eps=1e-8, weight_decay=0.0)
