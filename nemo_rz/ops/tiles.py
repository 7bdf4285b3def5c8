"""Fixed row tiles: the one trick behind every consistent CPU op.

A BLAS or ATen kernel picks its blocking, vectorisation tail and thread split from the *shape* it is given.
If every call sees the same shape, every row is computed the same way. So rows are padded with zeros to a
multiple of TILE_ROWS and handed to `torch.bmm` as a batch of [TILE_ROWS, K] matrices: the per-matrix
shape never depends on how many rows the caller had, and the batch count only changes how many identical
products run. Row sums go through the same bmm (against a ones vector), because ATen's reductions split a
long row across threads when there are few rows.
TILE_ROWS = 32 also keeps element-wise transcendental ops (exp, log) on sizes that are whole multiples of the
widest SIMD loop step, so no element takes a scalar tail path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TILE_ROWS = 32


def to_tiles(x: torch.Tensor) -> torch.Tensor:
    """[M, F] -> [ceil(M / TILE_ROWS), TILE_ROWS, F], zero-padded.

    When x is the first M rows of a larger contiguous tensor that already holds the padding rows (the output
    of an earlier tiled op, sliced), that tensor is reused instead of copying: a row's result never depends
    on the other rows of its tile, so whatever the extra rows hold does not matter. Not under autograd (a
    gradient would reach the extra rows' producer).
    """
    rows, features = x.shape
    pad = (-rows) % TILE_ROWS
    if rows == 0:
        pad = TILE_ROWS
    elif pad:
        padded = (rows + pad) * features
        base = x._base
        if (base is not None and base.numel() >= padded and x.data_ptr() == base.data_ptr() and x.is_contiguous()
                and base.is_contiguous() and base.dtype == x.dtype and not (base.requires_grad and torch.is_grad_enabled())):
            return x.as_strided(((rows + pad) // TILE_ROWS, TILE_ROWS, features), (TILE_ROWS * features, features, 1))
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.view(-1, TILE_ROWS, features) if x.is_contiguous() else x.reshape(-1, TILE_ROWS, features)


def from_tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of to_tiles: [C, TILE_ROWS, F] -> [rows, F]."""
    out = t.view(-1, t.shape[-1]) if t.is_contiguous() else t.reshape(-1, t.shape[-1])
    return out if out.shape[0] == rows else out[:rows]


def tiled_matmul(tiles: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """[C, R, K] @ [K, N] as C identical fixed-shape products.

    A one-column product takes a different BLAS path for C == 1 than for C > 1 (checked: torch 2.13 CPU),
    so N == 1 is computed as N == 2 with a zero column.
    """
    n = weight_t.shape[1]
    if n == 1:
        weight_t = F.pad(weight_t, (0, 1))
    out = torch.bmm(tiles, weight_t.expand(tiles.shape[0], *weight_t.shape))
    return out[..., :1] if n == 1 else out


_SUM_COLUMNS: dict = {}


def sum_columns(features: int, dtype: torch.dtype, device, scale: float = 1.0) -> torch.Tensor:
    """A cached [features, 2] matrix whose columns are all `scale`: x @ it sums x's rows (times scale)."""
    key = (features, scale, dtype, device)
    ones = _SUM_COLUMNS.get(key)
    if ones is None:
        ones = _SUM_COLUMNS[key] = torch.full((features, 2), scale, dtype=dtype, device=device)
    return ones


def row_sum(tiles: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sum (times scale) over the last dim of [C, R, F] -> [C, R, 1], in an order fixed by F alone."""
    c, _, f = tiles.shape
    return torch.bmm(tiles, sum_columns(f, tiles.dtype, tiles.device, scale).expand(c, f, 2)).narrow(2, 0, 1)
