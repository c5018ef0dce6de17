"""CompressedReducer: error feedback keeps the drift bounded, and the multi-rank reduce is within the int4 bound.

Bounds used here (fp32 error buffers, ``e_0 = 0``):
- one step: ``|D(Q(h)) - h| <= s / 2`` per element with ``s`` the element's group scale, so the reduced mean is
  within ``mean_w(s_w) / 2`` of the exact mean (plus the output dtype's rounding);
- error feedback: ``e_t = beta e_{t-1} + (1 - beta) r_t`` with ``|r_t| <= s_t / 2 <= max|h_t| / 14``; by
  induction ``|e_t| <= E = G / 13`` with ``G = max_t max|g_t|`` (from ``E <= (G + E) / 14``).  Summing the
  update over t gives ``sum_t D(q_t) - sum_t g_t = (e_0 - e_T) / (1 - beta)``, so the drift stays within
  ``G / (13 (1 - beta))`` for every T.
- bf16 buffers add one bf16 rounding (relative 2^-9) per step to that identity: the test checks the fp32
  bound plus ``T * E * 2^-9 / (1 - beta)`` (grows with T, slowly), which is why fp32 is the default.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rank_pool import run_on_ranks, run_on_ranks_then_discard
from shardtensor import ops
from shardtensor.ops import _int4
from shardtensor.optim import CompressedReducer

GROUP_SIZES = st.sampled_from([2, 6, 32, 128])


def _biased_gradients(seed: int, steps: int, shape: tuple[int, ...], noise: float = 0.3) -> list[torch.Tensor]:
    """Random gradients around a fixed mean that has one large value per row of 8: plain int4 rounds most of
    the mean to zero at every step (a steady bias), error feedback sends it over time."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(shape, generator=gen) * 0.05
    mean.view(-1)[::8] = 4.0
    return [mean + noise * torch.randn(shape, generator=gen) * 0.05 for _ in range(steps)]


def _drift(reducer: CompressedReducer, grads: list[torch.Tensor], *, final: bool = False):
    """max |sum_t reduced_t - sum_t g_t| after each step (world 1: the reduced gradient is D(Q(g + e))).

    With ``final=True`` also the last ``sum_t reduced_t - sum_t g_t`` itself.
    """
    sent = torch.zeros(grads[0].shape, dtype=torch.float64)
    true = torch.zeros(grads[0].shape, dtype=torch.float64)
    drifts = []
    for g in grads:
        sent += reducer.reduce(g, key="w", group=None).double()
        true += g.double()
        drifts.append((sent - true).abs().max())
    return (torch.stack(drifts), sent - true) if final else torch.stack(drifts)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 120), rows=st.integers(1, 9), cols=st.integers(1, 40),
    group_size=GROUP_SIZES, beta=st.sampled_from([0.0, 0.5, 0.8, 0.95]),
)  # fmt: skip
def test_error_feedback_drift_is_bounded_for_any_T(seed, steps, rows, cols, group_size, beta):
    grads = _biased_gradients(seed, steps, (rows, cols))
    reducer = CompressedReducer(group_size=group_size, beta=beta)
    drift, final = _drift(reducer, grads, final=True)
    g_max = max(g.abs().max().item() for g in grads)
    bound = g_max / 13 / (1 - beta)
    assert drift.max() <= bound * (1 + 1e-4), f"{drift.max()=} {bound=}"
    # the identity behind the bound: sum D - sum g = (e_0 - e_T) / (1 - beta), and |e_T| <= E = G / 13
    e_T = reducer.state_dict()["error_buffers"]["w"].view(rows, cols).double()
    torch.testing.assert_close(final, -e_T / (1 - beta), rtol=1e-5, atol=1e-6 * g_max * steps)
    assert (e_T.abs() <= g_max / 13 * (1 + 1e-4)).all()


def test_error_feedback_sum_identity():
    grads = _biased_gradients(0, 50, (7, 33))
    for beta in (0.0, 0.8):
        reducer = CompressedReducer(group_size=6, beta=beta)
        total = sum(reducer.reduce(g, key="w", group=None).double() - g.double() for g in grads)
        e_T = reducer.state_dict()["error_buffers"]["w"].view(7, 33).double()
        torch.testing.assert_close(total, -e_T / (1 - beta), rtol=1e-5, atol=1e-5)


def test_without_feedback_drift_grows_with_T():
    grads = _biased_gradients(1, 400, (4, 64))
    g_max = max(g.abs().max().item() for g in grads)
    with_feedback = _drift(CompressedReducer(group_size=32), grads)
    without = _drift(CompressedReducer(group_size=32, error_feedback=False), grads)
    bound = g_max / 13 / (1 - 0.8)
    assert with_feedback.max() <= bound
    assert without[-1] > 3 * without[99] > 0  # the bias grows linearly: ~4x from step 100 to 400
    assert without[-1] > 10 * bound  # far past what feedback guarantees
    assert with_feedback[-1] < without[-1] / 10


def test_bf16_error_buffer_drift_within_rounding_bound():
    steps, beta = 300, 0.8
    grads = _biased_gradients(2, steps, (4, 64))
    g_max = max(g.abs().max().item() for g in grads)
    e_max = g_max / 13
    drift = _drift(CompressedReducer(group_size=32, beta=beta, error_dtype=torch.bfloat16), grads)
    t = torch.arange(1, steps + 1, dtype=torch.float64)
    bound = (e_max * 1.01 + t * e_max * 2.0**-9) / (1 - beta)  # 1.01: bf16 may round |e| up past E
    assert (drift <= bound).all()


def test_state_dict_round_trip_resumes_identically():
    grads = _biased_gradients(3, 6, (5, 21))
    a = CompressedReducer(group_size=6)
    for g in grads[:3]:
        a.reduce(g, key="w", group=None)
    state = a.state_dict()
    assert state["error_buffers"]["w"].shape == (5 * 21,) and state["error_buffers"]["w"].abs().max() > 0
    b = CompressedReducer(group_size=6)
    b.load_state_dict(state)
    for g in grads[3:]:
        assert torch.equal(a.reduce(g, key="w", group=None), b.reduce(g, key="w", group=None))
    torch.testing.assert_close(a.state_dict()["error_buffers"]["w"], b.state_dict()["error_buffers"]["w"], rtol=0, atol=0)


def test_reducer_refuses_misuse():
    with pytest.raises(NotImplementedError):
        CompressedReducer(bits=8)
    with pytest.raises(ValueError, match="beta"):
        CompressedReducer(beta=1.0)
    r = CompressedReducer(group_size=4)
    r.reduce(torch.ones(2, 3), key="w", group=None)
    with pytest.raises(ValueError, match="another shape"):
        r.reduce(torch.ones(2, 5), key="w", group=None)


@pytest.mark.skipif(
    not (ops.triton_available() and __import__("os").environ.get("TRITON_INTERPRET") == "1"),
    reason="needs triton and TRITON_INTERPRET=1 to run the kernels on CPU tensors",
)
def test_reducer_on_triton_kernels_equals_reference(monkeypatch):
    # The reducer writes into strided views of one wire buffer; run that through the kernels (interpreted).
    grads = _biased_gradients(4, 3, (6, 13))
    ref = CompressedReducer(group_size=6)
    expected = [ref.reduce(g, key="w", group=None) for g in grads]
    monkeypatch.setattr(_int4, "_quantize_rows_dispatch", _int4._quantize_rows_triton)
    monkeypatch.setattr(_int4, "_reduce_rows_dispatch", _int4._reduce_rows_triton)
    tri = CompressedReducer(group_size=6)
    for g, want in zip(grads, expected):
        assert torch.equal(tri.reduce(g, key="w", group=None), want)
    assert torch.equal(tri.state_dict()["error_buffers"]["w"], ref.state_dict()["error_buffers"]["w"])


# ---- multi-rank (gloo workers from rank_pool) ---------------------------------------------------------------


def _rank_grads(seed: int, world: int, steps: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """grads[t][w]: rank w's full gradient at step t (every rank can rebuild everyone's)."""
    gen = torch.Generator().manual_seed(seed)
    return [[(torch.randn(shape, generator=gen) * (w + 1)).to(dtype) for w in range(world)] for _ in range(steps)]


def _reduce_on_rank(seed, shape, dtype, steps, group_size, error_feedback):
    from shardtensor import _comm

    world, rank = _comm.world_size(), _comm.rank()
    reducer = CompressedReducer(group_size=group_size, error_feedback=error_feedback)
    shards = [
        reducer.reduce(step[rank].contiguous(), key="p", group=None)
        for step in _rank_grads(seed, world, steps, shape, dtype)
    ]
    return shards, reducer.bytes_sent


def _mean_and_step_bound(grads: list[torch.Tensor], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact mean over ranks, and mean_w(s_w) / 2 per element (first step: no error yet)."""
    world = len(grads)
    mean = torch.stack([g.float() for g in grads]).mean(0)
    half_steps = []
    for g in grads:
        rows = g.float().reshape(world, -1)
        _, scales = ops.quantize_int4_ef_ref(rows, None, group_size)
        half_steps.append(scales.repeat_interleave(group_size, dim=1)[:, : rows.shape[1]].reshape(g.shape) / 2)
    return mean, torch.stack(half_steps).mean(0)


@settings(max_examples=15, deadline=None)
@given(
    world=st.sampled_from([2, 4]), seed=st.integers(0, 2**31 - 1), rows_per_rank=st.integers(1, 4),
    rest=st.sampled_from([(), (1,), (5,), (3, 7), (130,)]), group_size=GROUP_SIZES,
    dtype=st.sampled_from([torch.float32, torch.bfloat16]), error_feedback=st.booleans(),
)  # fmt: skip
def test_multi_rank_shard_within_quantization_bound_of_exact_mean(
    world, seed, rows_per_rank, rest, group_size, dtype, error_feedback
):
    shape = (world * rows_per_rank, *rest)
    steps = 3
    results = run_on_ranks(world, _reduce_on_rank, seed, shape, dtype, steps, group_size, error_feedback)
    grads = _rank_grads(seed, world, steps, shape, dtype)
    # step 0: each rank's shard is within mean_w(s_w)/2 of the exact mean (+ the output dtype's rounding)
    mean, half_step = _mean_and_step_bound(grads[0], group_size)
    full = torch.cat([shards[0] for shards, _ in results])
    assert full.shape == shape and full.dtype == dtype
    tol = half_step * (1 + 1e-5) + (mean.abs() + half_step) * (2**-8 if dtype == torch.bfloat16 else 1e-6)
    assert ((full.float() - mean).abs() <= tol).all()
    if error_feedback:  # over the steps the summed shards stay within the feedback bound of the summed means
        g_max = max(g.float().abs().max().item() for step in grads for g in step)
        sent = sum(torch.cat([shards[t] for shards, _ in results]).double() for t in range(steps))
        true = sum(torch.stack([g.double() for g in step]).mean(0) for step in grads)
        slack = 2**-7 * steps * g_max if dtype == torch.bfloat16 else 1e-5 * g_max
        assert (sent - true).abs().max() <= g_max / 13 / (1 - 0.8) + slack
    # wire bytes: (W, row) uint8 per call, identical on every rank
    assert len({b for _, b in results}) == 1 and results[0][1] > 0


def test_multi_rank_wire_bytes_are_7x_fewer_than_fp32():
    world, shape = 2, (256, 512)
    results = run_on_ranks(world, _reduce_on_rank, 0, shape, torch.float32, 1, 128, True)
    sent = results[0][1]
    fp32_bytes = shape[0] * shape[1] * 4  # what a fp32 reduce-scatter hands to the collective
    assert sent == shape[0] * shape[1] // 2 + shape[0] * shape[1] // 128 * 4  # 4 bits + one fp32 scale per 128
    assert fp32_bytes / sent >= 7.5


def _two_models_one_reducer_case() -> dict:
    """A GAN's or an actor-critic's two models of one architecture, each given the same reducer: their
    parameters of one name would share an error buffer."""
    from torch import nn

    from shardtensor import shard_module, unshard_module

    def build():
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))

    out = {}
    shared = CompressedReducer(group_size=4)
    first = shard_module(build(), reducer=shared)
    try:
        shard_module(build(), reducer=shared)
        out["second"] = "no error"
    except ValueError as exc:
        out["second"] = str(exc)
    unshard_module(first)
    try:  # its error buffers still hold the first model's residuals
        shard_module(build(), reducer=shared)
        out["after_unshard"] = "no error"
    except ValueError as exc:
        out["after_unshard"] = str(exc)
    shard_module(first, reducer=shared)  # the same model sharded again takes its own buffers back
    plain = CompressedReducer(group_size=4, error_feedback=False)  # no state: sharing is harmless
    shard_module(build(), reducer=plain)
    shard_module(build(), reducer=plain)
    return out


def test_one_reducer_with_error_feedback_for_two_models_is_refused_on_every_rank():
    for r in run_on_ranks(2, _two_models_one_reducer_case):
        for case in ("second", "after_unshard"):
            assert "already reduced another model's gradients" in r[case] and "Fix:" in r[case], r


def _zero_element_parameter_case() -> list:
    from torch import nn

    import shardtensor

    class Prefixed(nn.Module):  # prefix tuning with no virtual tokens: a (0, 6) parameter
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 6))
            self.prefix = nn.Parameter(torch.empty(0, 6))

        def forward(self, x):
            return (torch.cat([self.prefix, x]) @ self.w.t()).square().sum()

    torch.manual_seed(0)
    model = shardtensor.shard_module(Prefixed(), reducer=CompressedReducer())
    model(torch.randn(3, 6)).backward()
    return [tuple(model.prefix.grad.shape), model.w.grad.full_tensor().abs().sum().item() > 0]


def test_a_zero_element_parameter_reduces_to_an_empty_gradient():
    # Its 0-byte wire row failed inside backward with torch's "stride(0) must be divisible by 4", naming nothing.
    for shape, nonzero in run_on_ranks(2, _zero_element_parameter_case):
        assert shape == (0, 6) and nonzero


def _frozen_base_case(gather: str) -> dict:
    from torch import nn

    import shardtensor

    class Block(nn.Module):  # a frozen base weight and a trained low-rank adapter (LoRA-style fine-tuning)
        def __init__(self):
            super().__init__()
            self.base, self.down, self.up = nn.Linear(16, 16), nn.Linear(16, 2, bias=False), nn.Linear(2, 16)

        def forward(self, x):
            return torch.tanh(self.base(x) + self.up(self.down(x)))

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for block in model:
        block.base.requires_grad_(False)
    reducer = CompressedReducer(group_size=16)
    shardtensor.shard_module(model, gather=gather, reducer=reducer)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(5, 16, generator=gen)).square().sum().backward()
    return {"buffers": sorted(reducer.state_dict()["error_buffers"]), "sent": reducer.bytes_sent,
            "adapter": model[0].down.weight.grad.full_tensor()}


def test_frozen_parameters_are_not_reduced_in_any_gather_mode():
    # A gather unit (overlapped mode) handed its frozen parameters' zeros to the reducer every step: the compressed
    # reducer sent them and kept a float32 error buffer of each one's full size (28 GB per rank for a 7B base).
    sequential = run_on_ranks(2, _frozen_base_case, "sequential")
    for rank, out in enumerate(run_on_ranks(2, _frozen_base_case, "overlapped")):
        assert not [k for k in out["buffers"] if ".base." in k], out["buffers"]
        assert out["buffers"] == sequential[rank]["buffers"] and out["sent"] == sequential[rank]["sent"], out
        torch.testing.assert_close(out["adapter"], sequential[rank]["adapter"], rtol=0, atol=0)


def test_error_buffers_carry_the_models_own_keys_under_a_compile_wrapper():
    # shard_module(torch.compile(model)) named them '_orig_mod.<name>': a resume without compile loaded buffers no
    # parameter asked for again, and error feedback restarted at zero, silently.
    from torch import nn

    import shardtensor

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    saved_by = CompressedReducer(group_size=16)
    compiled = shardtensor.shard_module(torch.compile(build(), backend="eager"), reducer=saved_by)
    compiled(x).sum().backward()
    saved = saved_by.state_dict()
    assert sorted(saved["error_buffers"]) == sorted(shardtensor.full_state_dict(compiled))
    resumed_by = CompressedReducer(group_size=16)
    resumed = shardtensor.shard_module(build(), reducer=resumed_by)
    resumed_by.load_state_dict(saved)
    resumed(x).sum().backward()  # each parameter takes its loaded buffer: no key is left over
    assert sorted(resumed_by.state_dict()["error_buffers"]) == sorted(saved["error_buffers"])
    legacy = {**saved, "error_buffers": {"_orig_mod." + k: v for k, v in saved["error_buffers"].items()}}
    for state in (saved, legacy):  # (a state saved before: its keys still find their parameters)
        resumed_by.load_state_dict(state)
        for key, flat in resumed_by.state_dict()["error_buffers"].items():
            torch.testing.assert_close(flat, saved["error_buffers"][key], rtol=0, atol=0)


def test_error_buffers_saved_at_another_world_size_resume_where_they_fit():
    # A (5, 3) gradient at world 2 is padded to 6 rows: its saved buffer holds 18 values, the last 3 zeros (the
    # padding row's residual).  At world 1 it held "18 values, not 15" and was refused, on the loading ranks only.
    grad = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    saved = torch.randn(18, generator=torch.Generator().manual_seed(1))
    saved[15:] = 0
    refit, exact = CompressedReducer(group_size=4), CompressedReducer(group_size=4)
    refit.load_state_dict({"bits": 4, "error_buffers": {"w": saved}})
    exact.load_state_dict({"bits": 4, "error_buffers": {"w": saved[:15].clone()}})
    torch.testing.assert_close(refit.reduce(grad, key="w"), exact.reduce(grad, key="w"), rtol=0, atol=0)
    torch.testing.assert_close(refit.state_dict()["error_buffers"]["w"], exact.state_dict()["error_buffers"]["w"],
                               rtol=0, atol=0)
    saved[16] = 1.0  # not a padding residual: another parameter's buffer
    other = CompressedReducer(group_size=4)
    other.load_state_dict({"bits": 4, "error_buffers": {"w": saved}})
    with pytest.raises(ValueError, match="another parameter"):
        other.reduce(grad, key="w")


def _buffer_of_another_parameter_on_one_rank_case() -> str:
    from torch import nn

    import shardtensor

    shardtensor.set_collective_timeout(60)  # the others waited this long before; now a probe interval
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))
    reducer = CompressedReducer(group_size=4)
    shardtensor.shard_module(model, gather="sequential", reducer=reducer)
    if torch.distributed.get_rank() == 1:  # a resume where one rank's file holds another model's buffer
        wrong = torch.ones(6 * 4 + 5)
        reducer.load_state_dict({"bits": 4, "error_buffers": {"0.weight": wrong}})
    try:
        model(torch.randn(3, 4)).sum().backward()
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_an_error_buffer_refused_on_one_rank_is_named_on_every_rank():
    # The loading rank raised at its first backward; the others waited in the all-to-all until the collective
    # timeout (600 s by default) and then named only the timeout.
    import time

    start = time.monotonic()
    loaded, other = run_on_ranks_then_discard(2, _buffer_of_another_parameter_on_one_rank_case, timeout=120)[::-1]
    assert loaded.startswith("ValueError") and "another parameter" in loaded, loaded
    assert "DivergenceError" in other and "rank 1 already failed" in other and "another parameter" in other, other
    assert time.monotonic() - start < 50, "the other rank waited for the collective timeout"
