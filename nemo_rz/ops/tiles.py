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
    """[M, F] -> [ceil(M / TILE_ROWS), TILE_ROWS, F], zero-padded."""
    rows, features = x.shape
    pad = (-rows) % TILE_ROWS
    if pad or rows == 0:
        x = F.pad(x, (0, 0, 0, pad if rows else TILE_ROWS))
    return x.reshape(-1, TILE_ROWS, features)


def from_tiles(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of to_tiles: [C, TILE_ROWS, F] -> [rows, F]."""
    return t.reshape(-1, t.shape[-1])[:rows]


def tiled_matmul(tiles: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """[C, R, K] @ [K, N] as C identical fixed-shape products.

    A one-column product takes a different BLAS path for C == 1 than for C > 1 (checked: torch 2.13 CPU),
    so N == 1 is computed as N == 2 with a zero column.
    """
    n = weight_t.shape[1]
    if n == 1:
        weight_t = F.pad(weight_t, (0, 1))
    out = torch.bmm(tiles, weight_t.unsqueeze(0).expand(tiles.shape[0], -1, -1))
    return out[..., :1] if n == 1 else out


def row_sum(tiles: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of [C, R, F] -> [C, R, 1], in an order fixed by F alone."""
    ones = tiles.new_ones(tiles.shape[-1], 1)
    return tiled_matmul(tiles, ones)
