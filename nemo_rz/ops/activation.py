"""Gated MLP activations act(gate) * up: SwiGLU (silu), GeGLU with tanh-approximated gelu (Gemma), and
gpt-oss's clamped SwiGLU.

Consistent: float32, and the transcendental part (exp, tanh, sigmoid) runs either through a library kernel
probed row-invariant on this machine or on whole row tiles (no element falls into a vectorised loop's scalar
tail, which rounds differently). Clamps, adds and multiplies are correctly rounded wherever they run.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import by_recomputing, compute_dtype, kernel_op, on_gpu_kernels
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.tiles import TILE_ROWS, from_tiles, to_tiles
from nemo_rz.ops.verified import by_rows, rowwise_route


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not consistent():
        return F.silu(gate) * up
    if on_gpu_kernels(gate):
        from nemo_rz import kernels

        f = gate.shape[-1]
        out = kernel_op(kernels.silu_and_mul, by_recomputing(_silu_and_mul_reference), gate.reshape(-1, f), up.reshape(-1, f))
        return out.reshape(gate.shape)
    return _gated("silu", F.silu, gate, up)


def _silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    dt = compute_dtype(gate)
    return (F.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate) * up with gelu's tanh approximation (torch's approximate="tanh")."""
    if not consistent():
        return _gelu_tanh(gate) * up
    return _gated("gelu_tanh", _gelu_tanh, gate, up)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """(up.clamp(-limit, limit) + 1) * g * sigmoid(alpha * g) with g = gate.clamp(max=limit) (gpt-oss)."""

    def act(x: torch.Tensor) -> torch.Tensor:
        g = x.clamp(max=limit)
        return g * torch.sigmoid(g * alpha)

    def shift_up(u: torch.Tensor) -> torch.Tensor:
        return u.clamp(-limit, limit) + 1

    if not consistent():
        return act(gate) * shift_up(up)
    return _gated(f"clamped_swiglu({limit!r},{alpha!r})", act, gate, up, shift_up)


def _gated(name: str, act: Callable, gate: torch.Tensor, up: torch.Tensor,
           up_fn: Callable | None = None) -> torch.Tensor:
    """act(gate) * up_fn(up) in float32, row by row; `name` identifies act (and its constants) for the probe."""
    shape, f = gate.shape, gate.shape[-1]
    # A strided gate (half of a fused projection) would take the library's non-vectorised loop: other bits.
    g, u = gate.reshape(-1, f).contiguous(), up.reshape(-1, f)
    dt = compute_dtype(gate)
    if g.dtype != dt:
        g, u = g.to(dt), u.to(dt)
    if up_fn is not None:
        u = up_fn(u)
    rows = g.shape[0]
    route = rowwise_route(name, act, f, dt, gate.device)
    if route is not None:
        out = by_rows(act, g, route, elementwise=True) * u
    elif rows and rows % TILE_ROWS == 0 and g.is_contiguous() and u.is_contiguous():
        # Contiguous rows that are already whole tiles are used as is.
        out = act(g) * u
    else:
        out = from_tiles(act(to_tiles(g)) * to_tiles(u), rows)
    return (out if out.dtype == gate.dtype else out.to(gate.dtype)).view(shape)
