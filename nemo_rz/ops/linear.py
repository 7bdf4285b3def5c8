"""Linear layers and embedding lookup."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import compute_dtype, on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import from_tiles, tiled_matmul, to_tiles


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias over the last dim of x; weight is [N, K].

    Consistent: each output element's reduction order depends only on (K, N, dtype), never on how many
    rows x has or where a row sits (fixed row tiles; fp32 accumulation; output in x's dtype).
    """
    if not consistent():
        return F.linear(x, weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    if on_gpu_kernels(x):
        from nemo_rz import kernels

        return kernels.linear(x.reshape(-1, k), weight, bias).reshape(*x.shape[:-1], n)
    dt = compute_dtype(x)
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    m = rows.shape[0]
    if rows.dtype != dt:
        rows = rows.to(dt)
    # Rows are cut into [TILE_ROWS, K] tiles (zero-padded) and multiplied as one bmm of identical products.
    w_t = (weight if weight.dtype == dt else weight.to(dt)).t()
    out = from_tiles(tiled_matmul(to_tiles(rows), w_t), m)
    if bias is not None:
        out = out + (bias if bias.dtype == dt else bias.to(dt))
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Row lookup: exact in every mode."""
    return F.embedding(ids, weight)
