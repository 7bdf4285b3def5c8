"""Quantized linear layer: ``y = deq(x) @ deq(w).T + bias`` from fp8 (E4M3) or fp4 (E2M1) codes and per-block
decode multipliers, dequantized in the tile.

Decoding is exact integer work on the code bits (no fp8 cast: Triton's interpreter gets ~11% of those wrong),
then one fp32 multiply by the block's multiplier: the same single rounding as `QTensor.dequantize`, so a
dequantized tile equals the torch dequantization bit for bit. Invariance rule as kernels/matmul.py: one
program reduces y[m, n] over K in BLOCK_K chunks in increasing k order into a zero-started fp32 accumulator
(IEEE products, no TF32), bias added once after; the tile shape depends on (N, K) only, never on M.

Operands: ``codes`` uint8 [rows, K] (E4M3 bytes) or [rows, K/2] (two E2M1 codes a byte, the even element in
the low nibble); ``mult`` float32 [ceil(rows / block_rows), ceil(K / block_cols)].
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import check_device, next_pow2


@triton.jit
def _minifloat(code, EXP: tl.constexpr, MAN: tl.constexpr, SUBNORMAL_UNIT: tl.constexpr):
    """Codes of sign | EXP exponent bits | MAN mantissa bits (bias 2**(EXP-1) - 1; exponent 0 = subnormal,
    m * SUBNORMAL_UNIT) -> float32, from their bits: E4M3 is (4, 3, 2**-9), E2M1 (2, 1, 0.5)."""
    c = code.to(tl.uint32)
    sign = (c >> (EXP + MAN)) << 31
    e = (c >> MAN) & ((1 << EXP) - 1)
    m = c & ((1 << MAN) - 1)
    normal = (sign | ((e + (128 - (1 << (EXP - 1)))) << 23) | (m << (23 - MAN))).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * SUBNORMAL_UNIT
    return tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)


@triton.jit
def _load_dequantized(codes_ptr, mult_ptr, offs_r, kk, mask, stride_r, stride_mult, block_rows, block_cols,
                      FP4: tl.constexpr):
    """The [len(offs_r), len(kk)] tile of an operand, dequantized: element value * its block's multiplier."""
    rows = offs_r.to(tl.int64)
    if FP4:
        byte = tl.load(codes_ptr + rows[:, None] * stride_r + (kk >> 1)[None, :], mask=mask, other=0)
        elem = _minifloat((byte.to(tl.uint32) >> ((kk & 1) * 4).to(tl.uint32)[None, :]) & 0xF, 2, 1, 0.5)
    else:
        byte = tl.load(codes_ptr + rows[:, None] * stride_r + kk[None, :], mask=mask, other=0)
        elem = _minifloat(byte, 4, 3, 0.001953125)
    mult = tl.load(mult_ptr + (offs_r // block_rows).to(tl.int64)[:, None] * stride_mult + (kk // block_cols)[None, :],
                   mask=mask, other=0.0)
    return elem * mult


@triton.jit
def _quant_linear_kernel(
    x_ptr, xm_ptr, w_ptr, wm_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_x, stride_xm, stride_w, stride_wm, stride_y,
    x_block_rows, x_block_cols, w_block_rows, w_block_cols,
    X_FP4: tl.constexpr, W_FP4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        mask_k = kk < K
        a = _load_dequantized(x_ptr, xm_ptr, offs_m, kk, mask_m[:, None] & mask_k[None, :], stride_x, stride_xm,
                              x_block_rows, x_block_cols, X_FP4)
        b = _load_dequantized(w_ptr, wm_ptr, offs_n, kk, mask_n[:, None] & mask_k[None, :], stride_w, stride_wm,
                              w_block_rows, w_block_cols, W_FP4)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_y + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def tile_config(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for an (N, K) problem; deliberately no M argument."""
    return 64, min(64, max(16, next_pow2(N))), min(64, max(16, next_pow2(K)))


def _operand(q, what: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(2-D uint8 codes, float32 multipliers, is fp4) of a QTensor."""
    fp4 = q.data.dtype == torch.uint8
    if not fp4 and q.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"quant_linear: {what} codes must be float8_e4m3fn or packed E2M1 (uint8), got {q.data.dtype}")
    codes = q.data.reshape(-1, q.data.shape[-1])
    codes = (codes if fp4 else codes.view(torch.uint8)).contiguous()
    return codes, q.multipliers().to(torch.float32).contiguous(), fp4


def quant_linear(x, weight, bias: Optional[torch.Tensor] = None, block_k: Optional[int] = None) -> torch.Tensor:
    """``deq(x) [M, K] @ deq(weight) [N, K].T (+ bias) -> float32 [M, N]`` from two QTensors (nemo_rz.quant);
    row-invariant (see the module docstring). block_k overrides the K chunk (tests use it as a control)."""
    xc, xm, x_fp4 = _operand(x, "x")
    wc, wm, w_fp4 = _operand(weight, "weight")
    M, K = xc.shape[0], x.shape[-1]
    N = wc.shape[0]
    if weight.shape[-1] != K:
        raise ValueError(f"quant_linear: x is [M, K={K}] but weight is [N, K={weight.shape[-1]}]")
    tensors = [xc, xm, wc, wm] + ([bias] if bias is not None else [])
    check_device("quant_linear", tensors)
    y = torch.empty((M, N), dtype=torch.float32, device=xc.device)
    if M == 0 or N == 0:
        return y
    bm, bn, bk = tile_config(N, K)
    bk = block_k or bk
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _quant_linear_kernel[grid](
        xc, xm, wc, wm, bias if bias is not None else xm, y,
        M, N, K,
        xc.stride(0), xm.stride(0), wc.stride(0), wm.stride(0), y.stride(0),
        x.block[0], x.block[1], weight.block[0], weight.block[1],
        X_FP4=x_fp4, W_FP4=w_fp4, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
    )
    return y
