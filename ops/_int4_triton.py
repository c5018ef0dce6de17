"""Triton kernels for int4 gradient compression, one fused pass each.

- ``_quantize_int4_kernel``: (x [+ error]) -> packed int4 + per-group scales [+ updated error].  Reading the
  gradient and the error once and writing the bytes, the scales and the new error once is the whole cost of
  compression; separate add / absmax / divide / pack / update kernels would read the data five times.
- ``_dequantize_reduce_int4_kernel``: W received chunks (packed + scales) -> their fp32 sum, without writing
  W dequantized copies first.

Importing this module needs triton; ``_int4.py`` imports it lazily so that ``shardtensor.ops`` imports without
triton.  Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (that is how the tests run them).

Bit-exactness with the reference: divisions use ``div_rn`` (IEEE round-to-nearest; plain ``/`` on the GPU is an
approximate division), rounding is round-half-to-even like ``torch.round``.  On the GPU the compiler may fuse a
multiply and an add into an FMA in the error update and the W-way sum, so there the error buffer and the sum may
differ from the reference by an ulp; the packed bytes and scales do not depend on either.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    # torch.round rounds half to even.  floor + exact fraction: y - floor(y) is exact for |y| >= 1 (Sterbenz) and
    # for 0 <= y < 1; for -1 < y < 0 it may round up to 0.5 or 1.0 only when the true answer is 0 anyway.
    r = tl.floor(y)
    f = y - r
    half = r * 0.5
    odd = half != tl.floor(half)
    up = (f > 0.5) | ((f == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _round_to_bf16(x):
    # fp32 -> the nearest bf16 value (ties to even), still as fp32, so that the cast that follows is exact.
    # Why by hand: the GPU casts with round-to-nearest-even but the interpreter truncates; this agrees on both
    # and with torch's ``.to(torch.bfloat16)`` (finite values: a non-finite group keeps its old error).
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_int4_kernel(
    x_ptr,  # (R, n_cols), row stride stride_x
    err_ptr,  # (R, >= n_groups * GROUP) float32 / bfloat16, updated in place (unused without HAS_ERROR)
    packed_ptr,  # (R, row_bytes) uint8
    scales_ptr,  # (R, n_groups) float32
    n_cols,
    n_groups,
    row_bytes,
    stride_x,
    stride_err,
    stride_packed,
    stride_scales,
    beta,
    one_minus_beta,
    GROUP: tl.constexpr,
    HALF_P2: tl.constexpr,  # next power of two >= GROUP // 2 (tl.arange needs a power of two)
    BLOCK_G: tl.constexpr,  # groups per program
    HAS_ERROR: tl.constexpr,
    ERROR_BF16: tl.constexpr,
):
    row = tl.program_id(1).to(tl.int64)
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # (BLOCK_G,) group index in the row
    j = tl.arange(0, HALF_P2)  # (HALF_P2,) byte index in the group
    g_ok = g < n_groups
    pair = g[:, None] * (GROUP // 2) + j[None, :]  # (BLOCK_G, HALF_P2) byte index in the row
    pair_ok = g_ok[:, None] & (j[None, :] < GROUP // 2)
    col_lo = 2 * pair  # even elements -> low nibbles
    col_hi = col_lo + 1  # odd elements -> high nibbles

    x_row = x_ptr + row * stride_x
    h_lo = tl.load(x_row + col_lo, mask=pair_ok & (col_lo < n_cols), other=0.0).to(tl.float32)
    h_hi = tl.load(x_row + col_hi, mask=pair_ok & (col_hi < n_cols), other=0.0).to(tl.float32)
    if HAS_ERROR:
        err_row = err_ptr + row * stride_err
        e_lo = tl.load(err_row + col_lo, mask=pair_ok, other=0.0).to(tl.float32)
        e_hi = tl.load(err_row + col_hi, mask=pair_ok, other=0.0).to(tl.float32)
        h_lo = h_lo + e_lo
        h_hi = h_hi + e_hi

    # an inf/NaN in the group: a NaN scale and the error kept (see [Note: a non-finite group] in _int4_ref)
    finite = (tl.abs(h_lo) < float("inf")) & (tl.abs(h_hi) < float("inf"))  # False for inf and NaN
    nonfinite = tl.min(finite.to(tl.int32), axis=1) == 0  # (BLOCK_G,)
    amax = tl.maximum(tl.max(tl.abs(h_lo), axis=1), tl.max(tl.abs(h_hi), axis=1))  # (BLOCK_G,)
    scale = tl.where(nonfinite, float("nan"), tl.math.div_rn(amax, 7.0))
    nonzero = scale > 0.0  # a zero group keeps scale 0 and q 0, never 0/0 (and a NaN scale q 0)
    safe = tl.where(nonzero, scale, 1.0)[:, None]
    q_lo = tl.where(nonzero[:, None], _round_half_even(tl.math.div_rn(h_lo, safe)), 0.0)
    q_hi = tl.where(nonzero[:, None], _round_half_even(tl.math.div_rn(h_hi, safe)), 0.0)
    q_lo = tl.minimum(tl.maximum(q_lo, -8.0), 7.0)
    q_hi = tl.minimum(tl.maximum(q_hi, -8.0), 7.0)

    if HAS_ERROR:
        # LoCo: e <- beta * e + (1 - beta) * (h - D(Q(h)))
        new_lo = beta * e_lo + one_minus_beta * (h_lo - q_lo * scale[:, None])
        new_hi = beta * e_hi + one_minus_beta * (h_hi - q_hi * scale[:, None])
        if ERROR_BF16:
            new_lo = _round_to_bf16(new_lo)
            new_hi = _round_to_bf16(new_hi)
        e_lo = tl.where(nonfinite[:, None], e_lo, new_lo)
        e_hi = tl.where(nonfinite[:, None], e_hi, new_hi)
        tl.store(err_row + col_lo, e_lo.to(err_ptr.dtype.element_ty), mask=pair_ok)
        tl.store(err_row + col_hi, e_hi.to(err_ptr.dtype.element_ty), mask=pair_ok)

    byte = (q_lo.to(tl.int32) & 0xF) | ((q_hi.to(tl.int32) & 0xF) << 4)
    tl.store(packed_ptr + row * stride_packed + pair, byte.to(tl.uint8), mask=pair_ok & (pair < row_bytes))
    tl.store(scales_ptr + row * stride_scales + g, scale, mask=g_ok)


@triton.jit
def _dequantize_reduce_int4_kernel(
    packed_ptr,  # (W, n_bytes) uint8, row stride stride_packed
    scales_ptr,  # (W, >= n_groups) float32, row stride stride_scales
    out_ptr,  # (numel,) float32
    n_chunks,
    numel,
    n_groups,
    n_bytes,
    stride_packed,
    stride_scales,
    GROUP: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    g = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, HALF_P2)
    g_ok = g < n_groups
    pair = g[:, None] * (GROUP // 2) + j[None, :]
    pair_ok = g_ok[:, None] & (j[None, :] < GROUP // 2)
    byte_ok = pair_ok & (pair < n_bytes)
    acc_lo = tl.zeros((BLOCK_G, HALF_P2), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_G, HALF_P2), dtype=tl.float32)
    packed_ptrs = packed_ptr + pair
    scales_ptrs = scales_ptr + g
    for _ in range(n_chunks):  # chunk order, like the reference; pointers advance (64-bit) row by row
        b = tl.load(packed_ptrs, mask=byte_ok, other=0).to(tl.int32)
        s = tl.load(scales_ptrs, mask=g_ok, other=0.0)[:, None]
        packed_ptrs += stride_packed
        scales_ptrs += stride_scales
        lo = ((b & 0xF) ^ 8) - 8  # sign-extend the nibbles
        hi = ((b >> 4) ^ 8) - 8
        acc_lo += lo.to(tl.float32) * s
        acc_hi += hi.to(tl.float32) * s
    col_lo = 2 * pair
    tl.store(out_ptr + col_lo, acc_lo, mask=pair_ok & (col_lo < numel))
    tl.store(out_ptr + col_lo + 1, acc_hi, mask=pair_ok & (col_lo + 1 < numel))


def _block_groups(n_groups: int, half_p2: int) -> int:
    # ~4096 elements per program: enough work per program on the GPU, and few programs for the interpreter.
    return max(1, min(triton.next_power_of_2(max(n_groups, 1)), 4096 // (2 * half_p2)))


CUDA_GRID_LIMITS = (2**31 - 1, 65535, 65535)  # programs per launch-grid axis


def quantize_grid(rows: int, n_groups: int, block_g: int) -> tuple[int, int]:
    """The quantize kernel's launch grid for ``block_g`` groups per program: the group blocks on axis 0, whose
    limit is 2^31 - 1, and the rows on axis 1 (limit 65535; rows are few, one per rank).  The other way round, a
    2^28-element gradient is 65536 blocks, one past axis 1's limit: CUDA refuses the launch ("invalid
    argument"), as an H100 showed."""
    grid = (triton.cdiv(n_groups, block_g), rows)
    if any(n > limit for n, limit in zip(grid, CUDA_GRID_LIMITS)):
        raise ValueError(f"int4 quantize: {rows=} x {n_groups=} groups exceeds a launch grid {grid}")
    return grid


def quantize_rows_triton(
    x: torch.Tensor,
    error: Optional[torch.Tensor],
    packed: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    beta: float,
) -> None:
    """Launch ``_quantize_int4_kernel``; same contract as ``_int4_ref.quantize_rows_ref``."""
    rows, cols = x.shape
    n_groups = scales.shape[1]
    if rows == 0 or n_groups == 0:
        return
    half_p2 = triton.next_power_of_2(group_size // 2)
    block_g = _block_groups(n_groups, half_p2)
    grid = quantize_grid(rows, n_groups, block_g)
    _quantize_int4_kernel[grid](
        x, error if error is not None else scales, packed, scales,
        cols, n_groups, packed.shape[1],
        x.stride(0), error.stride(0) if error is not None else 0, packed.stride(0), scales.stride(0),
        float(beta), float(1.0 - beta),
        GROUP=group_size, HALF_P2=half_p2, BLOCK_G=block_g, HAS_ERROR=error is not None,
        ERROR_BF16=error is not None and error.dtype == torch.bfloat16,
    )  # fmt: skip


def dequantize_reduce_rows_triton(
    packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, group_size: int
) -> None:
    """Launch ``_dequantize_reduce_int4_kernel``; same contract as ``_int4_ref.dequantize_reduce_rows_ref``."""
    numel = out.numel()
    n_groups = triton.cdiv(numel, group_size)
    if numel == 0:
        return
    half_p2 = triton.next_power_of_2(group_size // 2)
    block_g = _block_groups(n_groups, half_p2)
    grid = (triton.cdiv(n_groups, block_g),)
    _dequantize_reduce_int4_kernel[grid](
        packed, scales, out,
        packed.shape[0], numel, n_groups, packed.shape[1],
        packed.stride(0), scales.stride(0),
        GROUP=group_size, HALF_P2=half_p2, BLOCK_G=block_g,
    )  # fmt: skip
