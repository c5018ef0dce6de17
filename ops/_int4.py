"""Blockwise symmetric int4 quantization: the public functions, their layouts, and the CPU/GPU dispatch.

[Note: int4 layout]
- Values are quantized in groups of ``group_size`` consecutive elements (even, 128 by default).  Per group
  ``s = max|x| / 7`` and ``q = clamp(round(x / s), -8, 7)`` (round half to even, as ``torch.round``), so every
  element is within ``s / 2`` of its input (|x| <= 7s, so the clamp never bites).  A group of zeros gets
  ``s = 0`` and ``q = 0`` (never 0/0).  ``D(q, s) = q * s``.
- Two values per byte: element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high nibble, as
  two's complement nibbles.  A 1-d tensor of ``n`` elements takes ``ceil(n / 2)`` bytes and
  ``ceil(n / group_size)`` float32 scales; the last group is padded with zeros.
- The row functions (``quantize_int4_ef``, ``dequantize_reduce_int4``) work on ``(R, C)`` rows, each row padded
  to whole groups on its own, so that row ``r`` of a reduce (rank ``r``'s shard) starts on a group boundary
  and can be sent alone.  A row of ``C`` columns takes ``G * group_size / 2`` bytes, ``G = ceil(C / group_size)``.

Dispatch: CUDA tensors run the Triton kernels (``_int4_triton.py``), CPU tensors the torch references
(``_int4_ref.py``).  The ``*_triton`` and ``*_ref`` functions force one path; under ``TRITON_INTERPRET=1`` the
``*_triton`` functions run on CPU tensors, which is how the tests compare the two.  Importing this module
never imports triton; a ``*_triton`` call without triton raises ``RuntimeError`` naming the import error.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from . import _int4_ref

_RowsQuantize = Callable[..., None]
_RowsReduce = Callable[..., None]

_triton_module = None
_triton_import_error: Optional[BaseException] = None


def triton_available() -> bool:
    """Whether the Triton kernels can be imported here (they still need a GPU or ``TRITON_INTERPRET=1`` to run)."""
    return _load_triton() is not None


def _load_triton():
    # Lazy: importing triton costs ~1 s and may be absent (macOS, Windows, a CPU-only install).
    global _triton_module, _triton_import_error
    if _triton_module is None and _triton_import_error is None:
        try:
            from . import _int4_triton

            _triton_module = _int4_triton
        except Exception as exc:  # noqa: BLE001 - any import failure means "no triton path"
            _triton_import_error = exc
    return _triton_module


def _triton_kernels():
    mod = _load_triton()
    if mod is None:
        raise RuntimeError(f"shardtensor.ops: the Triton int4 kernels are unavailable ({_triton_import_error!r})")
    return mod


class QuantizedInt4(NamedTuple):
    """int4 values packed two per byte, and one float32 scale per group (see [Note: int4 layout])."""

    packed: torch.Tensor  # uint8, (ceil(n/2),) or (R, G * group_size / 2)
    scales: torch.Tensor  # float32, (ceil(n/group_size),) or (R, G)


def _check_group_size(group_size: int) -> None:
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 groups must hold an even number of values (two per byte): {group_size=}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A 2-d view with unit column stride (1-d -> one row), what the kernels address."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise ValueError(f"expected a 1-d or 2-d tensor of rows: {tuple(x.shape)=}")
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()


def _quantize_int4(x: torch.Tensor, group_size: int, quantize_rows: _RowsQuantize) -> QuantizedInt4:
    _check_group_size(group_size)
    flat = x.detach().contiguous().view(1, -1)
    n = flat.shape[1]
    packed = torch.empty(1, (n + 1) // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(1, -(-n // group_size), dtype=torch.float32, device=x.device)
    quantize_rows(flat, None, packed, scales, group_size, 0.0)
    return QuantizedInt4(packed.view(-1), scales.view(-1))


def _dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, dtype: torch.dtype,
    reduce_rows: _RowsReduce,
) -> torch.Tensor:  # fmt: skip
    _check_group_size(group_size)
    if packed.numel() < (numel + 1) // 2 or scales.numel() < -(-numel // group_size):
        raise ValueError(f"too few bytes or scales for {numel=}: {packed.shape=} {scales.shape=} {group_size=}")
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    reduce_rows(_rows(packed.reshape(-1)), _rows(scales.reshape(-1)), out, group_size)
    return out if dtype == torch.float32 else out.to(dtype)


def _quantize_int4_ef(
    grad: torch.Tensor, error: Optional[torch.Tensor], group_size: int, beta: float,
    out: Optional[QuantizedInt4], quantize_rows: _RowsQuantize,
) -> QuantizedInt4:  # fmt: skip
    _check_group_size(group_size)
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"error feedback needs 0 <= beta < 1 (the drift bound is |e| / (1 - beta)): {beta=}")
    x = _rows(grad.detach())
    rows, cols = x.shape
    n_groups = -(-cols // group_size)
    padded = n_groups * group_size
    if error is not None:
        if tuple(error.shape) != (rows, padded) or error.stride(1) != 1 or not error.is_floating_point():
            raise ValueError(
                f"the error buffer must be a float (rows, padded cols) tensor with unit column stride: "
                f"{tuple(error.shape)=} expected {(rows, padded)}, {error.stride()=} {error.dtype=}"
            )
    if out is None:
        out = QuantizedInt4(
            torch.empty(rows, padded // 2, dtype=torch.uint8, device=x.device),
            torch.empty(rows, n_groups, dtype=torch.float32, device=x.device),
        )
    packed, scales = out
    if (
        tuple(packed.shape) != (rows, padded // 2) or packed.dtype != torch.uint8 or packed.stride(1) != 1
        or tuple(scales.shape) != (rows, n_groups) or scales.dtype != torch.float32 or scales.stride(1) != 1
    ):  # fmt: skip
        raise ValueError(
            f"out must be uint8 {(rows, padded // 2)} and float32 {(rows, n_groups)} with unit column stride: "
            f"{packed.shape=} {packed.dtype=} {packed.stride()=} {scales.shape=} {scales.dtype=} {scales.stride()=}"
        )
    quantize_rows(x, error, packed, scales, group_size, beta)
    return out


def _dequantize_reduce_int4(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int, reduce_rows: _RowsReduce
) -> torch.Tensor:
    _check_group_size(group_size)
    packed, scales = _rows(packed), _rows(scales)
    n_groups = -(-numel // group_size)
    if packed.shape[0] != scales.shape[0] or scales.shape[1] < n_groups or packed.shape[1] < (numel + 1) // 2:
        raise ValueError(f"chunks do not cover {numel=}: {packed.shape=} {scales.shape=} {group_size=}")
    out = torch.empty(numel, dtype=torch.float32, device=packed.device)
    reduce_rows(packed, scales, out, group_size)
    return out


# ---- public API: dispatching, reference, and Triton versions with one signature each -------------------------


def _quantize_rows_dispatch(x, error, packed, scales, group_size, beta) -> None:
    if x.is_cuda and triton_available():
        _triton_kernels().quantize_rows_triton(x, error, packed, scales, group_size, beta)
    else:
        _int4_ref.quantize_rows_ref(x, error, packed, scales, group_size, beta)


def _reduce_rows_dispatch(packed, scales, out, group_size) -> None:
    if packed.is_cuda and triton_available():
        _triton_kernels().dequantize_reduce_rows_triton(packed, scales, out, group_size)
    else:
        _int4_ref.dequantize_reduce_rows_ref(packed, scales, out, group_size)


def _quantize_rows_triton(*args) -> None:
    _triton_kernels().quantize_rows_triton(*args)


def _reduce_rows_triton(*args) -> None:
    _triton_kernels().dequantize_reduce_rows_triton(*args)


def quantize_int4(x: torch.Tensor, group_size: int = 128) -> QuantizedInt4:
    """Quantize ``x`` (flattened, any length) to packed int4 + per-group scales; see [Note: int4 layout].

    Returns ``(packed: uint8[ceil(n/2)], scales: float32[ceil(n/group_size)])``.
    """
    return _quantize_int4(x, group_size, _quantize_rows_dispatch)


def quantize_int4_ref(x: torch.Tensor, group_size: int = 128) -> QuantizedInt4:
    """``quantize_int4`` by the torch reference, on any device."""
    return _quantize_int4(x, group_size, _int4_ref.quantize_rows_ref)


def quantize_int4_triton(x: torch.Tensor, group_size: int = 128) -> QuantizedInt4:
    """``quantize_int4`` by ``_quantize_int4_kernel`` (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    return _quantize_int4(x, group_size, _quantize_rows_triton)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The 1-d tensor of ``numel`` values ``q * s`` that ``quantize_int4`` packed, in ``dtype``."""
    return _dequantize_int4(packed, scales, numel, group_size, dtype, _reduce_rows_dispatch)


def dequantize_int4_ref(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dequantize_int4`` by the torch reference."""
    return _dequantize_int4(packed, scales, numel, group_size, dtype, _int4_ref.dequantize_reduce_rows_ref)


def dequantize_int4_triton(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``dequantize_int4`` by ``_dequantize_reduce_int4_kernel`` with one chunk."""
    return _dequantize_int4(packed, scales, numel, group_size, dtype, _reduce_rows_triton)


def quantize_int4_ef(
    grad: torch.Tensor,
    error: Optional[torch.Tensor],
    group_size: int = 128,
    beta: float = 0.8,
    *,
    out: Optional[QuantizedInt4] = None,
) -> QuantizedInt4:
    """Quantize ``h = grad + error`` row by row and update ``error`` in place, in one pass.

    Why fused: this is the compressed reducer's whole send-side cost; one read of the gradient and the error
    and one write of bytes, scales and error (LoCo error feedback)::

        h = grad + error;  (q, s) = Q4(h);  error <- beta * error + (1 - beta) * (h - q * s)

    Args:
        grad: ``(R, C)`` rows (or 1-d: one row), any float dtype; each row is padded to whole groups on its own.
        error: ``(R, G * group_size)`` float32 or bfloat16 buffer (zeros at first), updated in place; ``None``
            quantizes ``grad`` alone (plain int4).
        group_size: values per scale (even). (Default: 128)
        beta: how much of the old error is kept, in [0, 1). (Default: 0.8, DeepSpeed's ``err_beta``)
        out: optional ``(packed (R, G * group_size / 2) uint8, scales (R, G) float32)`` to write into, e.g.
            views of one wire buffer; rows may be strided, columns must be contiguous.

    Returns:
        ``(packed, scales)`` as above.
    """
    return _quantize_int4_ef(grad, error, group_size, beta, out, _quantize_rows_dispatch)


def quantize_int4_ef_ref(
    grad: torch.Tensor,
    error: Optional[torch.Tensor],
    group_size: int = 128,
    beta: float = 0.8,
    *,
    out: Optional[QuantizedInt4] = None,
) -> QuantizedInt4:
    """``quantize_int4_ef`` by the torch reference."""
    return _quantize_int4_ef(grad, error, group_size, beta, out, _int4_ref.quantize_rows_ref)


def quantize_int4_ef_triton(
    grad: torch.Tensor,
    error: Optional[torch.Tensor],
    group_size: int = 128,
    beta: float = 0.8,
    *,
    out: Optional[QuantizedInt4] = None,
) -> QuantizedInt4:
    """``quantize_int4_ef`` by ``_quantize_int4_kernel``."""
    return _quantize_int4_ef(grad, error, group_size, beta, out, _quantize_rows_triton)


def dequantize_reduce_int4(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int = 128
) -> torch.Tensor:
    """Sum of the W dequantized chunks, ``sum_w packed[w] * scales[w]``, first ``numel`` values, in float32.

    Why fused: the receive side of the compressed reduce gets W chunks of its shard (one per rank); summing
    while unpacking writes the shard once instead of W dequantized copies.  Chunks are summed in order, chunk
    0 first.

    Args:
        packed: ``(W, B)`` uint8, one row per received chunk (row stride free, columns contiguous).
        scales: ``(W, >= ceil(numel / group_size))`` float32.
        numel: values per chunk to return (the unpadded shard).
        group_size: values per scale. (Default: 128)
    """
    return _dequantize_reduce_int4(packed, scales, numel, group_size, _reduce_rows_dispatch)


def dequantize_reduce_int4_ref(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int = 128
) -> torch.Tensor:
    """``dequantize_reduce_int4`` by the torch reference."""
    return _dequantize_reduce_int4(packed, scales, numel, group_size, _int4_ref.dequantize_reduce_rows_ref)


def dequantize_reduce_int4_triton(
    packed: torch.Tensor, scales: torch.Tensor, numel: int, group_size: int = 128
) -> torch.Tensor:
    """``dequantize_reduce_int4`` by ``_dequantize_reduce_int4_kernel``."""
    return _dequantize_reduce_int4(packed, scales, numel, group_size, _reduce_rows_triton)
