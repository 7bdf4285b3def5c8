"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight."""
from __future__ import annotations

import torch

from nemo_rz.ops.dispatch import by_recomputing, compute_dtype, kernel_op, on_gpu_kernels
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.tiles import from_tiles, row_sum, to_tiles
from nemo_rz.ops.verified import by_rows, rowwise_route


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not consistent():
        return weight * _normalized(x.float(), eps).to(x.dtype)
    shape, h = x.shape, x.shape[-1]
    rows = x.reshape(-1, h)
    if on_gpu_kernels(x):
        from nemo_rz import kernels

        def reference(r, w):  # the kernel's math: float32 throughout, one cast at the end
            return (_normalized(r.to(compute_dtype(r)), eps) * w.to(compute_dtype(r))).to(r.dtype)

        return kernel_op(lambda r, w: kernels.rms_norm(r, w, eps), by_recomputing(reference), rows, weight).reshape(shape)
    dt = compute_dtype(x)
    route = rowwise_route("rms_norm", lambda r: _normalized(r, 1e-6), h, dt, x.device)
    if route is not None:
        y = by_rows(lambda r: _normalized(r, eps), rows if rows.dtype == dt else rows.to(dt), route)
        return (weight * y.to(x.dtype)).view(shape)
    t = to_tiles(rows if rows.dtype == dt else rows.to(dt))
    # mean(x^2) is a fixed-shape product with a column of 1/h; rsqrt is 1 / sqrt, both correctly rounded, so
    # every code path (vector body or tail) gives the same bits.
    y = t * torch.rsqrt(row_sum(t * t, 1.0 / h) + eps)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    # The weight is applied on the whole tiles, so the result is a slice of them (the next op reuses the tiles).
    return from_tiles(weight * y, rows.shape[0]).view(shape)
