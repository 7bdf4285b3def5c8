"""SwiGLU's gate: silu(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import compute_dtype, on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import TILE_ROWS, from_tiles, to_tiles
from nemo_rz.ops.verified import by_rows, rowwise_route


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not consistent():
        return F.silu(gate) * up
    shape, f = gate.shape, gate.shape[-1]
    g, u = gate.reshape(-1, f), up.reshape(-1, f)
    if on_gpu_kernels(gate):
        from nemo_rz import kernels

        return kernels.silu_and_mul(g, u).reshape(shape)
    dt = compute_dtype(gate)
    if g.dtype != dt:
        g, u = g.to(dt), u.to(dt)
    rows = g.shape[0]
    route = rowwise_route("silu", F.silu, f, dt, gate.device)
    if route is not None:
        out = by_rows(F.silu, g, route) * u
        return (out if out.dtype == gate.dtype else out.to(gate.dtype)).view(shape)
    # silu's exp runs vectorised over whole SIMD steps only on whole row tiles (no element falls into a
    # scalar tail loop with different rounding). Contiguous rows that are already whole tiles are used as is.
    if rows and rows % TILE_ROWS == 0 and g.is_contiguous() and u.is_contiguous():
        out = F.silu(g) * u
    else:
        out = from_tiles(F.silu(to_tiles(g)) * to_tiles(u), rows)
    return (out if out.dtype == gate.dtype else out.to(gate.dtype)).view(shape)
