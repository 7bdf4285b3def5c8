"""Batch-invariant RMSNorm: ``y = x * 1/sqrt(mean(x^2) + eps) * weight``.

Invariance rule: one program per row. The sum of squares is accumulated in fp32 lane by lane over
fixed-size blocks of H in increasing order (BLOCK_H depends only on H), then reduced across lanes by one
``tl.sum`` of a fixed shape. The normalisation ``x * rstd * weight`` is computed in fp32 and cast once.
Nothing depends on M or on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_tensor, next_pow2

MAX_BLOCK_H = 4096


def block_h(H: int) -> int:
    """Block over the hidden dimension: a function of H only."""
    return min(MAX_BLOCK_H, next_pow2(H))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    y_row = y_ptr + row * H
    offs = tl.arange(0, BLOCK_H)
    sq = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        m = h0 + offs < H
        v = tl.load(x_row + h0 + offs, mask=m, other=0.0).to(tl.float32)
        sq += v * v
    mean = tl.div_rn(tl.sum(sq, axis=0), H.to(tl.float32))
    rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    for h0 in range(0, H, BLOCK_H):
        m = h0 + offs < H
        v = tl.load(x_row + h0 + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + h0 + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_row + h0 + offs, (v * rstd * w).to(y_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [M, H]``, ``weight [H]`` -> ``[M, H]`` in x's dtype; fp32 arithmetic, one row per program.

    x needs a contiguous last dim; weight may be any float dtype (read as fp32)."""
    check_tensor("rms_norm", "x", x, 2, rows_strided=True)
    check_tensor("rms_norm", "weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"rms_norm: weight is [{weight.shape[0]}] but x is [M, H={x.shape[1]}]")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"rms_norm: eps must be a float >= 0, got {eps!r}")
    check_device("rms_norm", [x, weight])
    M, H = x.shape
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    if M == 0 or H == 0:
        return y
    bh = block_h(H)
    _rms_norm_kernel[(M,)](x, weight, y, H, x.stride(0), float(eps), BLOCK_H=bh, num_warps=4 if bh <= 1024 else 8)
    return y
