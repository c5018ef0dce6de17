"""Kernels for shardtensor: Triton versions for CUDA tensors, torch references for the CPU, and the CPU AdamW step
with its inf/NaN check inside (C, compiled on first use; ``adamw_cpu_kernel_status()`` says whether it runs).

Importing this package never imports triton (see ``_int4.py``).
"""

from ._adamw_cpu import adamw_checked_, adamw_checked_ref_, adamw_cpu_kernel_status
from ._int4 import (
    QuantizedInt4,
    dequantize_int4,
    dequantize_int4_ref,
    dequantize_int4_triton,
    dequantize_reduce_int4,
    dequantize_reduce_int4_ref,
    dequantize_reduce_int4_triton,
    quantize_int4,
    quantize_int4_ef,
    quantize_int4_ef_ref,
    quantize_int4_ef_triton,
    quantize_int4_ref,
    quantize_int4_triton,
    triton_available,
)

__all__ = [
    "adamw_checked_",
    "adamw_checked_ref_",
    "adamw_cpu_kernel_status",
    "QuantizedInt4",
    "dequantize_int4",
    "dequantize_int4_ref",
    "dequantize_int4_triton",
    "dequantize_reduce_int4",
    "dequantize_reduce_int4_ref",
    "dequantize_reduce_int4_triton",
    "quantize_int4",
    "quantize_int4_ef",
    "quantize_int4_ef_ref",
    "quantize_int4_ef_triton",
    "quantize_int4_ref",
    "quantize_int4_triton",
    "triton_available",
]
