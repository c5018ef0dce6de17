"""Properties of the int4 kernels: references, and Triton against the references.

The Triton kernels run under ``TRITON_INTERPRET=1`` on CPU tensors (as CI runs them) or on a GPU; otherwise, or
without triton, those tests skip with the reason.  Sizes stay small: the interpreter runs kernels in numpy.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardtensor import ops
from shardtensor.ops import _int4_ref

SETTINGS = settings(max_examples=25, deadline=None)
GROUP_SIZES = st.sampled_from([2, 6, 32, 128])  # 6: a group that is not a power of two

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_can_run_triton = ops.triton_available() and (DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(
    not _can_run_triton,
    reason="Triton kernels need triton and a GPU, or TRITON_INTERPRET=1 to run on the CPU"
    + ("" if ops.triton_available() else " (triton cannot be imported here)"),
)


def _assert_same(a: torch.Tensor, b: torch.Tensor, *, fused_multiply_add: bool = False) -> None:
    # Bit for bit on the CPU (interpreter and reference do the same IEEE float32 operations).  On the GPU the
    # compiler may contract a * b + c into an FMA: one rounding fewer, so allow an ulp there (see _int4_triton).
    if fused_multiply_add and a.is_cuda:
        torch.testing.assert_close(a, b, rtol=2**-22, atol=1e-30)
    else:
        assert torch.equal(a, b), f"max difference {(a.float() - b.float()).abs().max().item()}"


@st.composite
def gradients(draw, max_numel: int = 700) -> torch.Tensor:
    """Float32 vectors with the cases that break quantizers: zero groups, exact ties, huge and tiny magnitudes."""
    n = draw(st.integers(1, max_numel))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kind = draw(st.sampled_from(["normal", "halves", "outliers", "sparse"]))
    if kind == "halves":  # multiples of 1/2 in [-7, 7]: with a 7 in a group, s = 1 and x / s hits .5 ties
        x = torch.randint(-14, 15, (n,), generator=gen).float() / 2
    else:
        x = torch.randn(n, generator=gen)
        if kind == "outliers":
            x[torch.rand(n, generator=gen) < 0.02] *= 1000
        if kind == "sparse":
            x[torch.rand(n, generator=gen) < 0.7] = 0
    x *= 10.0 ** draw(st.integers(-6, 6))
    if draw(st.booleans()):  # a whole run of zeros, often a whole group
        start = draw(st.integers(0, n - 1))
        x[start : start + draw(st.integers(1, 300))] = 0
    return x.to(DEVICE)


def _group_scales(scales: torch.Tensor, numel: int, group_size: int) -> torch.Tensor:
    """Each element's scale."""
    return scales.repeat_interleave(group_size)[:numel]


# ---- the quantizer's contract (reference; dispatching functions on this device) -----------------------------


@SETTINGS
@given(x=gradients(), group_size=GROUP_SIZES)
def test_every_element_within_half_a_step(x, group_size):
    packed, scales = ops.quantize_int4(x, group_size)
    assert packed.dtype == torch.uint8 and packed.numel() == (x.numel() + 1) // 2
    assert scales.numel() == -(-x.numel() // group_size)
    padded = torch.nn.functional.pad(x, (0, scales.numel() * group_size - x.numel()))
    assert torch.equal(scales, padded.view(-1, group_size).abs().amax(-1) / 7)  # s = max|x| / 7
    out = ops.dequantize_int4(packed, scales, x.numel(), group_size)
    step = _group_scales(scales, x.numel(), group_size)
    # |x| <= 7s so the clamp never bites; the float32 slack covers q * s and x / s roundings (a few ulps of s)
    assert ((out - x).abs() <= step * (0.5 + 2**-20)).all()


@SETTINGS
@given(x=gradients(), group_size=GROUP_SIZES)
def test_zeros_stay_zeros(x, group_size):
    packed, scales = ops.quantize_int4(x, group_size)
    out = ops.dequantize_int4(packed, scales, x.numel(), group_size)
    assert torch.isfinite(out).all() and torch.isfinite(scales).all()
    assert (out[x == 0] == 0).all()
    padded = torch.nn.functional.pad(x, (0, scales.numel() * group_size - x.numel()))
    zero_groups = (padded.view(-1, group_size) == 0).all(-1)
    assert (scales[zero_groups] == 0).all()


@SETTINGS
@given(
    n=st.integers(1, 600), group_size=GROUP_SIZES, seed=st.integers(0, 2**31 - 1),
    scale_exp=st.integers(-20, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)  # fmt: skip
def test_pack_unpack_round_trips(n, group_size, seed, scale_exp, dtype):
    # Values already on the int4 grid (q * 2^k with a +-7 in every group, so s = 2^k exactly) come back exactly.
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-7, 8, (n,), generator=gen)
    q[::group_size] = torch.where(torch.rand(len(q[::group_size]), generator=gen) < 0.5, 7, -7)
    x = (q.float() * 2.0**scale_exp).to(dtype).to(DEVICE)
    packed, scales = ops.quantize_int4(x, group_size)
    assert torch.equal(ops.dequantize_int4(packed, scales, n, group_size, dtype=dtype), x)
    # and the nibble packing itself, over the whole range -8..7
    nibbles = torch.randint(-8, 8, (3, 2 * n), generator=gen)
    assert torch.equal(_int4_ref._unpack_nibbles(_int4_ref._pack_nibbles(nibbles)), nibbles.to(torch.int16))


@SETTINGS
@given(x=gradients(max_numel=300), world=st.integers(1, 4), group_size=GROUP_SIZES, seed=st.integers(0, 2**31 - 1))
def test_dequantize_reduce_equals_sum_of_dequantizations(x, world, group_size, seed):
    gen = torch.Generator().manual_seed(seed)
    chunks = torch.stack([x * torch.randn((), generator=gen).item() for _ in range(world)])  # (W, C)
    packed, scales = ops.quantize_int4_ef(chunks, None, group_size)
    summed = ops.dequantize_reduce_int4(packed, scales, x.numel(), group_size).cpu()
    # Independent of the library's decoders: the byte format decoded here in Python (element 2j is byte j's low
    # nibble, 2j+1 its high one, two's complement), times its group's scale, summed in chunk order in float32.
    expect = torch.zeros(x.numel())
    packed_rows, scale_rows = packed.cpu().tolist(), scales.cpu()
    for w in range(world):
        nibbles = [n for b in packed_rows[w] for n in (b & 0xF, b >> 4)][: x.numel()]
        ints = torch.tensor([n - 16 if n >= 8 else n for n in nibbles], dtype=torch.float32)
        group_scale = scale_rows[w][torch.arange(x.numel()) // group_size]
        decoded = ints * group_scale
        # ... and that decoding is the quantization of the chunk: within half a step of every element.
        assert ((decoded - chunks[w].cpu()).abs() <= group_scale * 0.5001 + 1e-30).all(), w
        expect += decoded
    torch.testing.assert_close(summed, expect, rtol=1e-6, atol=1e-6 * float(expect.abs().max()) + 1e-30)


@SETTINGS
@given(
    x=gradients(max_numel=300), rows=st.integers(1, 3), group_size=GROUP_SIZES, seed=st.integers(0, 2**31 - 1),
    beta=st.sampled_from([0.0, 0.5, 0.8, 0.99]),
)  # fmt: skip
def test_fused_error_feedback_step_is_the_loco_update(x, rows, group_size, seed, beta):
    # One fused pass == the unfused composition h = g + e; Q4(h); e <- beta e + (1 - beta)(h - D(Q4(h))).
    gen = torch.Generator().manual_seed(seed)
    grad = torch.stack([x.roll(r) for r in range(rows)])  # (R, C)
    cols = grad.shape[1]
    padded = -(-cols // group_size) * group_size
    error = (torch.randn(rows, padded, generator=gen) * x.abs().max().cpu()).to(DEVICE)
    error[:, cols:] = 0  # the padding of a real buffer stays zero
    e0 = error.clone()
    packed, scales = ops.quantize_int4_ef(grad, error, group_size, beta)
    assert torch.equal(error[:, cols:], torch.zeros_like(error[:, cols:]))
    for r in range(rows):
        h = grad[r] + e0[r, :cols]
        expect_packed, expect_scales = ops.quantize_int4(h, group_size)
        assert torch.equal(packed[r, : expect_packed.numel()], expect_packed)
        assert torch.equal(scales[r], expect_scales)
        residual = h - ops.dequantize_int4(expect_packed, expect_scales, cols, group_size)
        torch.testing.assert_close(error[r, :cols], beta * e0[r, :cols] + (1 - beta) * residual, rtol=1e-6, atol=1e-30)


_QUANTIZERS = {"ref": ops.quantize_int4_ef_ref, "triton": ops.quantize_int4_ef_triton}


@SETTINGS
@given(
    x=gradients(max_numel=300), rows=st.integers(1, 3), group_size=GROUP_SIZES, seed=st.integers(0, 2**31 - 1),
    bad=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([float("inf"), float("-inf"), float("nan")])),
                 min_size=1, max_size=4),
    impl=st.sampled_from(["ref", "triton"] if _can_run_triton else ["ref"]),
)  # fmt: skip
def test_a_non_finite_group_is_sent_as_nan_and_keeps_its_error_feedback(x, rows, group_size, seed, bad, impl):
    # An overflowed step (skipped by GradScaler or CPUAdam) must not fold its inf into the error buffer: every
    # later step would be non-finite too.  Its groups go out as NaN (so every rank sees the skip); the other
    # groups are quantized as if the bad elements were not there.
    gen = torch.Generator().manual_seed(seed)
    grad = torch.stack([x.roll(r) for r in range(rows)])
    cols = grad.shape[1]
    padded = -(-cols // group_size) * group_size
    error = (torch.randn(rows, padded, generator=gen) * x.abs().max().cpu()).to(DEVICE)
    error[:, cols:] = 0
    clean = grad.clone()
    for position, value in bad:
        grad.view(-1)[position % grad.numel()] = value
    broken = ~torch.isfinite(grad)
    clean[broken] = 0
    bad_groups = torch.zeros(rows, padded, dtype=torch.bool, device=DEVICE)
    bad_groups[:, :cols] = broken
    bad_groups = bad_groups.view(rows, -1, group_size).any(-1)  # (R, G)
    e0, clean_error = error.clone(), error.clone()
    got = _QUANTIZERS[impl](grad, error, group_size, 0.8)
    want = _QUANTIZERS[impl](clean, clean_error, group_size, 0.8)
    assert torch.isfinite(error).all()
    per_group = lambda t: t.view(rows, -1, group_size)  # noqa: E731
    assert torch.equal(per_group(error)[bad_groups], per_group(e0)[bad_groups])
    assert torch.equal(per_group(error)[~bad_groups], per_group(clean_error)[~bad_groups])
    assert got.scales[bad_groups].isnan().all() and torch.equal(got.scales[~bad_groups], want.scales[~bad_groups])
    for r in range(rows):
        values = ops.dequantize_int4(got.packed[r], got.scales[r], cols, group_size)
        expect = ops.dequantize_int4(want.packed[r], want.scales[r], cols, group_size)
        in_bad = bad_groups[r].repeat_interleave(group_size)[:cols]
        assert values[in_bad].isnan().all() and torch.equal(values[~in_bad], expect[~in_bad])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="even"):
        ops.quantize_int4(torch.ones(4), group_size=3)
    with pytest.raises(ValueError, match="beta"):
        ops.quantize_int4_ef(torch.ones(2, 4), torch.zeros(2, 4), group_size=4, beta=1.0)
    with pytest.raises(ValueError, match="error buffer"):
        ops.quantize_int4_ef(torch.ones(2, 5), torch.zeros(2, 5), group_size=4)  # must be padded to 8


# ---- Triton (interpreted on the CPU) against the reference -------------------------------------------------


@needs_triton
@SETTINGS
@given(x=gradients(), group_size=GROUP_SIZES)
def test_triton_quantize_equals_reference(x, group_size):
    ref = ops.quantize_int4_ref(x, group_size)
    tri = ops.quantize_int4_triton(x, group_size)
    _assert_same(tri.packed, ref.packed)
    _assert_same(tri.scales, ref.scales)
    n = x.numel()
    _assert_same(ops.dequantize_int4_triton(*ref, n, group_size), ops.dequantize_int4_ref(*ref, n, group_size))


@needs_triton
@SETTINGS
@given(
    x=gradients(max_numel=300), rows=st.integers(1, 4), group_size=GROUP_SIZES, seed=st.integers(0, 2**31 - 1),
    error_dtype=st.sampled_from([None, torch.float32, torch.bfloat16]), beta=st.sampled_from([0.0, 0.8, 0.99]),
    grad_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)  # fmt: skip
def test_triton_fused_error_feedback_equals_reference(x, rows, group_size, seed, error_dtype, beta, grad_dtype):
    gen = torch.Generator().manual_seed(seed)
    grad = torch.stack([x.roll(r) for r in range(rows)]).to(grad_dtype)
    padded = -(-grad.shape[1] // group_size) * group_size
    error_ref = None
    if error_dtype is not None:
        error_ref = (torch.randn(rows, padded, generator=gen) * x.abs().max().cpu()).to(DEVICE, error_dtype)
    error_tri = None if error_ref is None else error_ref.clone()
    ref = ops.quantize_int4_ef_ref(grad, error_ref, group_size, beta)
    tri = ops.quantize_int4_ef_triton(grad, error_tri, group_size, beta)
    _assert_same(tri.packed, ref.packed)
    _assert_same(tri.scales, ref.scales)
    if error_ref is not None:
        _assert_same(error_tri, error_ref, fused_multiply_add=True)


@needs_triton
@SETTINGS
@given(x=gradients(max_numel=300), world=st.integers(1, 4), group_size=GROUP_SIZES, strided=st.booleans())
def test_triton_dequantize_reduce_equals_reference(x, world, group_size, strided):
    chunks = torch.stack([x.roll(w) * (w + 1) for w in range(world)])
    packed, scales = ops.quantize_int4_ef_ref(chunks, None, group_size)
    if strided:  # rows inside a wider buffer, as the reducer's wire buffer lays them out
        wide = torch.zeros(world, packed.shape[1] + 5, dtype=torch.uint8, device=DEVICE)
        wide[:, 3 : 3 + packed.shape[1]] = packed
        packed = wide[:, 3 : 3 + packed.shape[1]]
    n = x.numel()
    ref = ops.dequantize_reduce_int4_ref(packed, scales, n, group_size)
    _assert_same(ops.dequantize_reduce_int4_triton(packed, scales, n, group_size), ref, fused_multiply_add=True)


@needs_triton
@pytest.mark.parametrize("numel", [1 << 28, 3 << 28])
def test_quantize_launch_grid_fits_cuda_limits(numel):
    # A 2^28-element gradient once needed 65536 programs on grid axis 1 (limit 65535): CUDA refused the launch.
    import triton

    from shardtensor.ops._int4_triton import CUDA_GRID_LIMITS, _block_groups, quantize_grid

    for rows, group_size in [(1, 128), (8, 32), (1, 2)]:
        n_groups = -(-numel // group_size)
        grid = quantize_grid(rows, n_groups, _block_groups(n_groups, triton.next_power_of_2(group_size // 2)))
        assert all(n <= limit for n, limit in zip(grid, CUDA_GRID_LIMITS)), (rows, group_size, grid)
        assert grid[1] == rows
