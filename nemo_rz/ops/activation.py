"""SwiGLU's gate: silu(gate) * up."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import compute_dtype, on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import from_tiles, to_tiles


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not consistent():
        return F.silu(gate) * up
    lead, f = gate.shape[:-1], gate.shape[-1]
    g, u = gate.reshape(-1, f), up.reshape(-1, f)
    if on_gpu_kernels(gate):
        from nemo_rz import kernels

        return kernels.silu_and_mul(g, u).reshape(*lead, f)
    dt = compute_dtype(gate)
    # exp on whole tiles: no element falls into a scalar tail loop with different rounding.
    gt, ut = to_tiles(g.to(dt)), to_tiles(u.to(dt))
    out = gt / (1.0 + torch.exp(-gt)) * ut
    return from_tiles(out, g.shape[0]).to(gate.dtype).reshape(*lead, f)
