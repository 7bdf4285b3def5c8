"""Batch-invariant SwiGLU activation: ``silu(gate) * up`` computed as ``gate / (1 + exp(-gate)) * up``.

Invariance rule: element-wise, in fp32, cast once. The grid is (row, column block) with a fixed
BLOCK_F that depends only on F, so element ``[m, f]`` is always computed at the same lane of a block of
the same shape, with the same instruction sequence, whatever M is or where the row sits in the batch
(no vectorised main loop versus scalar tail split that could depend on the total size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_tensor, next_pow2

MAX_BLOCK_F = 2048


def block_f(F: int) -> int:
    return min(MAX_BLOCK_F, next_pow2(F))


@triton.jit
def _silu_and_mul_kernel(g_ptr, u_ptr, y_ptr, F, stride_g, stride_u, BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = offs < F
    g = tl.load(g_ptr + row * stride_g + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.div_rn(g, 1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + row * F + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate [M, F]``, ``up [M, F]`` -> ``gate / (1 + exp(-gate)) * up`` in gate's dtype.

    Inputs need a contiguous last dim only (e.g. the two halves of a fused gate/up projection)."""
    check_tensor("silu_and_mul", "gate", gate, 2, rows_strided=True)
    check_tensor("silu_and_mul", "up", up, 2, rows_strided=True)
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"silu_and_mul: up {tuple(up.shape)} {up.dtype} must match gate "
                         f"{tuple(gate.shape)} {gate.dtype}")
    check_device("silu_and_mul", [gate, up])
    M, F = gate.shape
    y = torch.empty((M, F), dtype=gate.dtype, device=gate.device)
    if M == 0 or F == 0:
        return y
    bf = block_f(F)
    _silu_and_mul_kernel[(M, triton.cdiv(F, bf))](gate, up, y, F, gate.stride(0), up.stride(0), BLOCK_F=bf, num_warps=4)
    return y
