"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight."""
from __future__ import annotations

import torch

from nemo_rz.ops.dispatch import compute_dtype, on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import from_tiles, row_sum, to_tiles


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not consistent():
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * y.to(x.dtype)
    lead, h = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, h)
    if on_gpu_kernels(x):
        from nemo_rz import kernels

        return kernels.rms_norm(rows, weight, eps).reshape(*lead, h)
    t = to_tiles(rows.to(compute_dtype(x)))
    # sqrt and division are correctly rounded, so they give the same bits on any code path.
    inv = 1.0 / torch.sqrt(row_sum(t * t) / h + eps)
    y = from_tiles(t * inv, rows.shape[0]).to(x.dtype)
    return (weight * y).reshape(*lead, h)
