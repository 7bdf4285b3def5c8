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
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if on_gpu_kernels(x):
        from nemo_rz import kernels

        return kernels.linear(rows, weight, bias).reshape(*lead, weight.shape[0])
    dt = compute_dtype(x)
    out = from_tiles(tiled_matmul(to_tiles(rows.to(dt)), weight.to(dt).t()), rows.shape[0])
    if bias is not None:
        out = out + bias.to(dt)
    return out.to(x.dtype).reshape(*lead, weight.shape[0])


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Row lookup: exact in every mode."""
    return F.embedding(ids, weight)
