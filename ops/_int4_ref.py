"""Plain torch references for the int4 kernels: the CPU path, and the oracle the Triton kernels are tested against.

Every function here has the signature of its Triton twin in ``_int4_triton.py`` and computes the same float32
operations in the same order (``h = x + e``, ``s = amax / 7``, ``q = clamp(round_half_even(h / s), -8, 7)``,
``e' = beta * e + (1 - beta) * (h - q * s)``, and the W-way sum accumulated chunk 0 first), so that on the CPU
under ``TRITON_INTERPRET=1`` the two agree bit for bit.  See [Note: int4 layout] in ``_int4.py``.
"""

from __future__ import annotations

from typing import Optional

import torch


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(R, 2B) integer values in [-8, 7] -> (R, B) uint8; element 2i in the low nibble, 2i+1 in the high one."""
    nib = q.to(torch.int16) & 0xF  # two's complement nibble
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(R, B) uint8 -> (R, 2B) int16 in [-8, 7]: the inverse of ``_pack_nibbles``."""
    b = packed.to(torch.int16)
    lo = ((b & 0xF) ^ 8) - 8  # sign-extend the nibble
    hi = ((b >> 4) ^ 8) - 8
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


@torch.no_grad()
def quantize_rows_ref(
    x: torch.Tensor,  # (R, C), any float dtype
    error: Optional[torch.Tensor],  # (R, >= G * group_size), float32 or bfloat16, updated in place; or None
    packed: torch.Tensor,  # (R, row_bytes) uint8 out, row_bytes <= G * group_size / 2
    scales: torch.Tensor,  # (R, G) float32 out
    group_size: int,
    beta: float,
) -> None:
    """Quantize each row of ``x`` (plus ``error``) into ``packed``/``scales``; update ``error`` (LoCo feedback).

    [Note: a non-finite group]
    A group holding an inf/NaN (an overflowed step, which GradScaler or CPUAdam will skip) is sent with a NaN
    scale, so every rank's reduced gradient is non-finite there whatever the maximum of the hardware drops, and
    its error feedback is kept as it was: folding the inf into ``error`` would poison every later step (each
    would be non-finite and skipped, for good, without a word).
    """
    rows, cols = x.shape
    n_groups = scales.shape[1]
    padded = n_groups * group_size
    h = torch.zeros(rows, padded, dtype=torch.float32, device=x.device)
    h[:, :cols] = x
    if error is not None:
        e = error[:, :padded].float()
        h += e
    hg = h.view(rows, n_groups, group_size)
    nonfinite = ~torch.isfinite(hg).all(dim=-1)  # (R, G): see [Note: a non-finite group]
    scale = (hg.abs().amax(dim=-1) / 7).masked_fill_(nonfinite, float("nan"))  # (R, G)
    nonzero = (scale > 0).unsqueeze(-1)
    safe = torch.where(nonzero, scale.unsqueeze(-1), torch.ones((), device=x.device))
    q = torch.where(nonzero, torch.round(hg / safe), torch.zeros((), device=x.device)).clamp_(-8, 7)
    if error is not None:
        d = (q * scale.unsqueeze(-1)).view(rows, padded)
        beta32 = torch.tensor(beta, dtype=torch.float32, device=x.device)
        omb32 = torch.tensor(1.0 - beta, dtype=torch.float32, device=x.device)
        kept = nonfinite.repeat_interleave(group_size, dim=1)
        error[:, :padded] = torch.where(kept, e, beta32 * e + omb32 * (h - d))
    packed.copy_(_pack_nibbles(q.view(rows, padded))[:, : packed.shape[1]])
    scales.copy_(scale)


@torch.no_grad()
def dequantize_reduce_rows_ref(
    packed: torch.Tensor,  # (W, B) uint8
    scales: torch.Tensor,  # (W, >= G) float32
    out: torch.Tensor,  # (numel,) float32 out, G = ceil(numel / group_size)
    group_size: int,
) -> None:
    """``out = sum_w D(packed[w], scales[w])[:numel]``, summed in chunk order (chunk 0 first)."""
    chunks, n_bytes = packed.shape
    numel = out.numel()
    n_groups = -(-numel // group_size)
    q = torch.zeros(chunks, n_groups * group_size, dtype=torch.int16, device=packed.device)
    used_bytes = min(n_bytes, n_groups * group_size // 2)
    q[:, : 2 * used_bytes] = _unpack_nibbles(packed[:, :used_bytes])
    qg = q.view(chunks, n_groups, group_size).float()
    s = scales[:, :n_groups].unsqueeze(-1)
    acc = torch.zeros(n_groups, group_size, dtype=torch.float32, device=packed.device)
    for w in range(chunks):
        acc += qg[w] * s[w]
    out.copy_(acc.view(-1)[:numel])
