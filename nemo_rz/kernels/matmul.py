"""Batch-invariant linear layer: ``y = x @ weight.T + bias`` as a persistent Triton matmul.

Invariance rule: every output element ``y[m, n]`` is reduced over K by one program, in BLOCK_K chunks in
increasing k order, into an fp32 accumulator that starts at zero; bias is added once after the full
reduction and the result is cast once. The tile shape comes from ``tile_config(dtype, N, K)``, which never
sees M, and there is no split-K. So the arithmetic for a row depends only on (dtype, N, K) and the row's
own values: not on M, on the other rows, or on where the row sits in the batch. The persistent schedule
(which program handles which tile) changes with M and the SM count, but only moves whole tiles between
programs; it never changes how one tile is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from ._common import check_device, check_tensor, next_pow2, num_sms


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


def tile_config(dtype: torch.dtype, N: int, K: int) -> TileConfig:
    """The one tile configuration for a (dtype, N, K) problem. Deliberately has no M argument."""
    if dtype == torch.float32:
        bm, bn, bk = 128, 128, 32
    else:  # bf16 / fp16
        bm, bn, bk = 128, 128, 64
    bn = min(bn, max(16, next_pow2(N)))
    bk = min(bk, max(16, next_pow2(K)))
    return TileConfig(block_m=bm, block_n=bn, block_k=bk)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    num_programs,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    tiles_per_group = GROUP_M * tiles_n
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, num_programs):
        # grouped ordering for L2 reuse; it only picks WHICH tile, never how it is reduced
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % tiles_per_group) % group_rows
        tile_n = (tile % tiles_per_group) // group_rows
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows_x = offs_m.to(tl.int64) * stride_xm  # int64: M * N can pass 2**31 (e.g. logits)
        rows_w = offs_n.to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            mask_k = kk < K
            a = tl.load(x_ptr + rows_x[:, None] + kk[None, :],
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptr + rows_w[None, :] + kk[:, None],
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _check(x, weight, bias):
    check_tensor("linear", "x", x, 2, rows_strided=True)
    check_tensor("linear", "weight", weight, 2, rows_strided=True)
    if weight.dtype != x.dtype:
        raise ValueError(f"linear: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"linear: x is [M, K={x.shape[1]}] but weight is [N, K={weight.shape[1]}]")
    tensors = [x, weight]
    if bias is not None:
        check_tensor("linear", "bias", bias, 1)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(f"linear: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        tensors.append(bias)
    check_device("linear", tensors)


def _linear(x, weight, bias, config_fn: Callable[..., TileConfig]) -> torch.Tensor:
    """Launch with a given config function ``config_fn(dtype, N, K, M)`` (tests use it for controls)."""
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias.expand(M, N))
    cfg = config_fn(x.dtype, N, K, M)
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    programs = max(1, min(tiles, num_sms(x.device)))
    _linear_kernel[(programs,)](
        x, weight, bias if bias is not None else x, y,
        M, N, K,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_programs=programs,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias [N]) -> [M, N]`` in x's dtype, fp32 accumulation.

    x and weight share one dtype (fp32, fp16 or bf16) and need a contiguous last dim (row strides are
    free); bias may be any float dtype (added in fp32). fp32 inputs use IEEE fp32 products (no TF32).
    Row-invariant: see the module docstring.
    """
    _check(x, weight, bias)
    return _linear(x, weight, bias, lambda dtype, N, K, M: tile_config(dtype, N, K))
