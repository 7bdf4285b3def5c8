"""Batch-invariant grouped GEMM for mixture-of-experts layers: ``y[m] = x[m] @ weight_t[experts[m]] (+ bias)``.

Invariance rule: rows are grouped by expert (a stable sort, on the device) and each expert's rows are cut
into tiles of BLOCK_M rows starting at the group's first row; one program computes one (tile, column block)
in fp32, reducing over K in BLOCK_K chunks in increasing k order from zero, then adds the bias once and casts
once. The tile shape comes from ``tile_config(dtype, N, K)``, which sees neither the number of rows nor how
many rows an expert received, and a row's arithmetic never mixes with the other rows of its tile. So a row's
bits depend only on the row, its expert's weights and (dtype, N, K): not on the expert's load, the batch or
the row's place in it.

The grid is sized for the worst case (``cdiv(M, BLOCK_M) + E`` tiles), and the tile table is built with torch
ops on the device, so a launch needs no host synchronisation; tiles past the last expert's store nothing.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import INDEX_DTYPES, check_device, check_tensor
from .matmul import TileConfig, tile_config


@triton.jit
def _expert_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, order_ptr, tile_expert_ptr, tile_start_ptr, group_end_ptr,
    N, K, E,
    stride_xm, stride_we, stride_wk, stride_be, stride_ym,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)  # E for a tile past the last group: it stores nothing
    valid = expert < E
    expert = tl.minimum(expert, E - 1).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.where(valid, tl.load(group_end_ptr + expert), start)
    slots = start + tl.arange(0, BLOCK_M)
    mask_m = slots < end
    rows = tl.load(order_ptr + slots, mask=mask_m, other=0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        a = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_base + kk[:, None].to(tl.int64) * stride_wk + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def tile_table(experts: torch.Tensor, n_experts: int, block_m: int):
    """(row order grouped by expert, expert of each tile, first slot of each tile, end slot of each group),
    all on the device; the tile count is the worst case cdiv(M, block_m) + n_experts."""
    m = experts.shape[0]
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=n_experts)
    group_end = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    n_tiles = triton.cdiv(m, block_m) + n_experts
    t = torch.arange(n_tiles, device=experts.device)
    tile_expert = torch.searchsorted(tile_end, t, right=True)  # n_experts past the last tile
    e = tile_expert.clamp(max=n_experts - 1)
    tile_start = (group_end - counts)[e] + (t - (tile_end - tiles)[e]) * block_m
    return order, tile_expert, tile_start, group_end


def _check(x, experts, weight_t, bias):
    name = "expert_linear"
    check_tensor(name, "x", x, 2, rows_strided=True)
    check_tensor(name, "experts", experts, 1, INDEX_DTYPES)
    check_tensor(name, "weight_t", weight_t, 3)
    if weight_t.dtype != x.dtype:
        raise ValueError(f"{name}: weight_t dtype {weight_t.dtype} differs from x dtype {x.dtype}")
    if weight_t.shape[1] != x.shape[1] or experts.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: x [M, K={x.shape[1]}], experts [M] and weight_t [E, K, N] disagree: "
                         f"{tuple(x.shape)}, {tuple(experts.shape)}, {tuple(weight_t.shape)}")
    tensors = [x, experts, weight_t]
    if bias is not None:
        check_tensor(name, "bias", bias, 2)
        if bias.shape != (weight_t.shape[0], weight_t.shape[2]):
            raise ValueError(f"{name}: bias must be [E, N] = {[weight_t.shape[0], weight_t.shape[2]]}, got {tuple(bias.shape)}")
        tensors.append(bias)
    check_device(name, tensors)


def _expert_linear(x, experts, weight_t, bias, cfg: TileConfig) -> torch.Tensor:
    M, K = x.shape
    E, _, N = weight_t.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    order, tile_expert, tile_start, group_end = tile_table(experts, E, cfg.block_m)
    grid = (tile_expert.shape[0], triton.cdiv(N, cfg.block_n))
    _expert_linear_kernel[grid](
        x, weight_t, bias if bias is not None else x, y, order, tile_expert, tile_start, group_end,
        N, K, E,
        x.stride(0), weight_t.stride(0), weight_t.stride(1), bias.stride(0) if bias is not None else 0, y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return y


def expert_config(dtype: torch.dtype, N: int, K: int) -> TileConfig:
    """The dense tile shape with 64-row tiles: an expert's group is a slice of a batch, often small."""
    cfg = tile_config(dtype, N, K)
    return TileConfig(block_m=64, block_n=cfg.block_n, block_k=cfg.block_k, num_warps=4, num_stages=cfg.num_stages)


def expert_linear(x: torch.Tensor, experts: torch.Tensor, weight_t: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x [M, K]``, ``experts [M]`` (int), ``weight_t [E, K, N]`` (x's dtype, contiguous), ``bias [E, N]`` (any
    float dtype) -> ``[M, N]`` in x's dtype, fp32 accumulation; row m uses expert ``experts[m]``. Expert indices
    are not range-checked here (no device sync). Row-invariant: see the module docstring."""
    _check(x, experts, weight_t, bias)
    return _expert_linear(x, experts, weight_t, bias, expert_config(x.dtype, weight_t.shape[2], weight_t.shape[1]))
