"""AdamW on CPU fp32 lists: the step (torch's fused kernel), its algebraic inverse, and gradient norms.

Why a separate module: ``CPUAdam`` decides *when* a parameter steps (speculatively on a worker, or at ``step()``)
and this module decides *how*.  The inverse is written against the exact float32 arithmetic of the CPU kernel
(``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``, ADAMW mode), so that each inverted operation undoes the
rounded value the forward stored rather than an idealised one.  See [Note: rollback error].

[Note: rollback error]
The forward step, per element, in float32 (``w = f32(1-b1)``, ``c = f32(1-b2)``, ``d = f32(1 - lr*wd)``):
    p1 = p0 * d                               (only when wd != 0)
    m1 = m0 + w * (g - m0)                    (a lerp, fused multiply-add)
    v1 = v0 * b2 + (c * g) * g
    u  = (s * m1) / (sqrt(v1) / bc2_sqrt + eps)      s = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t)
    p2 = p1 - u
The inverse recomputes ``u`` bit for bit from the stored ``m1, v1`` (same operations, same order), so
``p1' = p2 + u`` is within one rounding of ``p1``; ``p0' = p1' / d``; ``m0' = lerp(m1, g, -w / (1 - w))``;
``v0' = max((v1 - (c g) g) / b2, 0)``.  Undoing step 1 resets ``m, v`` to exact zeros (AdamW starts from zeros),
which removes SuperOffload's "v slightly negative at t=1".  What remains: a few ulps on ``p``, and on ``m`` an
absolute error of a few ulps of ``|g|`` (large *relative* error where ``|m0| << |g|``: cancellation).  The test
``test_rollback_error_is_a_few_ulps`` measures it; the benchmark reports it.

[Note: a zero second moment]
``v0 = 0`` means every earlier gradient of that element was zero (or underflowed when squared), so ``m0`` was zero
too: an embedding row no earlier batch used.  The inverse recovers ``v0`` exactly there (``v1 = round((c g) g)``
is what it subtracts) but ``m0`` only to within a few ulps of ``(1 - b1) |g|``, and a state with ``v = 0`` and
``m != 0`` is not harmless: the next step moves that element by ``lr m / eps``, not by about ``lr``.  Measured
before this rule: an embedding 1.2e-5 off torch's AdamW one step after a skipped step (lr 1e-3), growing after.
So where the recovered ``v0`` is zero and the recovered ``m0`` lies within the inverse's own error of zero (16 ulps
of ``(|m1| + w |g|) / (1 - w)``), ``m0`` is set to zero.  Not wherever ``v0`` comes back zero: a tiny positive
``v0`` below the rounding of ``v1`` also comes back zero, beside an ``m0`` the inverse recovers well; zeroing that
one was measured to cost more than it saves (a speculative run redone after a manual clip, 4e-5 off torch).
Within the error band, zero is as good an answer as the inverse's.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Hyper(NamedTuple):
    """One param group's hyper-parameters as read at queue time (a queued step must not see later changes)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def hyper_of(group: dict) -> Hyper:
    b1, b2 = group["betas"]
    return Hyper(float(group["lr"]), float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))


def _f32(x: float) -> float:
    """``x`` rounded to float32, as the kernel's ``scalar_t(x)`` does, back as a Python float."""
    return float(torch.tensor(x, dtype=torch.float32))


@torch.no_grad()
def adamw_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: Hyper,
) -> None:
    """One AdamW step in place; ``steps`` (0-d float32 tensors) already hold the new step count ``t``.

    A thin call of ``torch._fused_adamw_`` (vectorised, ``at::parallel_for`` inside): no per-step grouping by
    device/dtype as ``torch.optim.AdamW`` does, because our lists are CPU fp32 by construction.
    """
    if not params:
        return
    torch._fused_adamw_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps,
        lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps,
        amsgrad=False, maximize=False,
    )


@torch.no_grad()
def adamw_rollback_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    hp: Hyper,
    nonfinite_untouched: bool = False,
) -> None:
    """Invert ``adamw_step_`` in place, given the gradients it used; ``steps`` go from ``t`` back to ``t - 1``.

    No saved copy of the state: the inverse is algebraic (see [Note: rollback error] for what is exact).
    Foreach ops on the whole list: the inverse is a rare path (clipping, inf/NaN), so it trades a few
    temporaries for simplicity.  ``nonfinite_untouched``: the step was the checked one (``adamw_checked_``),
    which left every element with an inf/NaN gradient as it was; those elements stay as they are.
    """
    if not params:
        return
    if nonfinite_untouched:
        grads, restore = _untouched_elements(params, grads, exp_avgs, exp_avg_sqs)
        adamw_rollback_(params, grads, exp_avgs, exp_avg_sqs, steps, hp)
        for tensor, where, kept in restore:
            tensor[where] = kept
        return
    ts = [int(s.item()) for s in steps]
    if min(ts) < 1:
        raise AssertionError(f"rollback of a parameter that never stepped: {ts=}")
    bc2_sqrt = [math.sqrt(1.0 - hp.beta2**t) for t in ts]
    step_size = [hp.lr / (1.0 - hp.beta1**t) for t in ts]

    # u = (s * m1) / (sqrt(v1) / bc2_sqrt + eps): the same rounded value the forward subtracted.
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, [_f32(b) for b in bc2_sqrt])
    torch._foreach_add_(denom, _f32(hp.eps))
    upd = torch._foreach_mul(exp_avgs, [_f32(s) for s in step_size])
    torch._foreach_div_(upd, denom)
    torch._foreach_add_(params, upd)
    if hp.weight_decay != 0.0:
        torch._foreach_div_(params, _f32(1.0 - hp.lr * hp.weight_decay))
    del upd

    first = [i for i, t in enumerate(ts) if t == 1]  # back to step 0: moments were exact zeros
    later = [i for i, t in enumerate(ts) if t > 1]
    if later:
        m = [exp_avgs[i] for i in later]
        v = [exp_avg_sqs[i] for i in later]
        g = [grads[i] for i in later]
        w = _f32(1.0 - hp.beta1)
        # the inverse's own error on m0, a few ulps of its inputs: see [Note: a zero second moment]
        noise = [] if hp.beta1 == 0.0 else [(mi.abs() + gi.abs() * w) * (16 * torch.finfo(torch.float32).eps / (1.0 - w))
                                           for mi, gi in zip(m, g)]
        if hp.beta1 == 0.0:  # m1 = g: m0 is gone, and no later step reads it; zeros keep the state defined
            torch._foreach_zero_(m)
        else:  # m0 = m1 + (-w / (1 - w)) (g - m1): a lerp again; more often bit-exact than (m1 - w g) / (1 - w)
            torch._foreach_lerp_(m, g, -w / (1.0 - w))
        if hp.beta2 == 0.0:
            torch._foreach_zero_(v)
        else:
            c = _f32(1.0 - hp.beta2)
            sq = torch._foreach_mul(g, c)  # (c * g) * g, the forward's order
            torch._foreach_mul_(sq, g)
            torch._foreach_sub_(v, sq)
            torch._foreach_div_(v, _f32(hp.beta2))
            torch._foreach_clamp_min_(v, 0.0)
            if hp.beta1 != 0.0:  # see [Note: a zero second moment]
                for mi, vi, ni in zip(m, v, noise):
                    mi.masked_fill_((vi == 0.0) & (mi.abs() <= ni), 0.0)
    for i in first:
        exp_avgs[i].zero_()
        exp_avg_sqs[i].zero_()
    torch._foreach_add_(steps, torch.ones(()), alpha=-1.0)


def _untouched_elements(params, grads, exp_avgs, exp_avg_sqs):
    """Gradients with zeros where they are inf/NaN (so the inverse stays finite there), and (tensor, where,
    values) to put those elements of p, m, v back afterwards: the checked step never changed them."""
    safe, restore = [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        bad = ~torch.isfinite(g)
        if not bad.any():
            safe.append(g)
            continue
        safe.append(torch.where(bad, 0.0, g))
        restore += [(t, bad, t[bad].clone()) for t in (p, m, v)]
    return safe, restore


@torch.no_grad()
def finite_checks(grads: list[torch.Tensor]) -> list[float]:
    """0.0 per finite gradient, inf otherwise: the check without the norm (``sum`` reads at memory speed, about
    twice as fast as ``vector_norm`` on the CPU; a sum is non-finite iff an element is, or it overflows)."""
    return [0.0 if math.isfinite(float(g.sum())) else math.inf for g in grads]


@torch.no_grad()
def sq_norms(grads: list[torch.Tensor]) -> list[float]:
    """Squared L2 norm of each gradient, as Python floats (inf/NaN where a gradient is not finite).

    One function for the speculative worker (lists of one) and for ``step()`` (whole lists), so that both paths
    see the same bits and make the same clipping decision.
    """
    if not grads:
        return []
    return [float(n) ** 2 for n in torch._foreach_norm(grads)]


def refuse_variants(groups: list, where: str) -> None:
    """CPUAdam runs AdamW's plain update: a param group asking for a variant it does not implement (given to the
    constructor or ``add_param_group``, or loaded from torch's Adam/AdamW state dict) is refused before anything
    changes, not stepped silently as plain AdamW."""
    for index, group in enumerate(groups):
        asked = [key for key in ("amsgrad", "maximize") if group.get(key)]
        if group.get("decoupled_weight_decay") is False and group.get("weight_decay", 0) != 0:
            asked.append("decoupled_weight_decay=False (torch.optim.Adam's L2 weight decay)")
        if asked:
            raise ValueError(f"CPUAdam.{where}: param group {index} asks for {', '.join(asked)}, which CPUAdam "
                             "does not implement (its update is AdamW's: decoupled weight decay, no amsgrad, "
                             "minimising). Fix: drop those settings, or step these parameters with torch.optim.AdamW.")
