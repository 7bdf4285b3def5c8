"""Batch-invariant causal attention over a KV cache (GQA, optional sliding window, optional paging).

Invariance rule: one program per (query token, KV head); its rows are the query heads of that KV group,
whose arithmetic never mixes (each row has its own dot products and its own softmax state). Keys are
visited in blocks of the module constant ``KV_BLOCK`` at absolute key indices ``[b*KV_BLOCK,
(b+1)*KV_BLOCK)``, in increasing b, from the block holding the first visible key (``window_start``) to
the block holding the query's own position, with an online softmax (running max, rescaled sum and
accumulator in fp32). Blocks with no visible key are never visited, so there is nothing to mask out
exactly. The work for a query depends only on its sequence's cached K/V, its position and the window:
decode (one query), full prefill, chunked prefill and any batch composition run the same blocks in the
same order, and paged and contiguous caches differ only in addresses.

Attention sinks (gpt-oss): one logit per query head joins the softmax denominator after the last block
(the running max and sum rescaled to max(m, sink), plus exp(sink - max)) and adds no value: a fixed step at
the end of each row, so the rule above is unchanged.

Caches must already hold the K/V of every visible key, including the query's own token.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._common import INDEX_DTYPES, check_device, check_tensor, next_pow2
from .window import check_window, window_start

KV_BLOCK = 32


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, seq_ptr, pos_ptr, start_ptr, bt_ptr, sink_ptr,
    scale, stride_qt, stride_qh, bt_stride, cache_stride0, cache_stride1,
    H: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SINKS: tl.constexpr,
    G_PAD: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK: tl.constexpr, IEEE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    seq = tl.load(seq_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    if HAS_WINDOW:
        start = tl.load(start_ptr + tok).to(tl.int64)
    else:
        start = pos * 0

    rows = tl.arange(0, G_PAD)
    heads = kvh * GROUP + rows
    row_ok = rows < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full((G_PAD,), -float("inf"), tl.float32)
    denom = tl.zeros((G_PAD,), dtype=tl.float32)
    acc = tl.zeros((G_PAD, BLOCK_D), dtype=tl.float32)
    kk = tl.arange(0, KV_BLOCK)
    for b in range(start // KV_BLOCK, pos // KV_BLOCK + 1):
        keys = b * KV_BLOCK + kk
        visible = (keys >= start) & (keys <= pos)
        if PAGED:
            page = tl.load(bt_ptr + seq * bt_stride + keys // PAGE_SIZE, mask=visible, other=0).to(tl.int64)
            base = page * cache_stride0 + kvh * cache_stride1 + (keys % PAGE_SIZE) * D
        else:
            base = seq * cache_stride0 + kvh * cache_stride1 + keys * D
        kv_mask = visible[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(visible[None, :], s * scale, -float("inf"))
        # every visited block holds at least one visible key, so m_new is finite
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m = m_new
    if HAS_SINKS:
        sink = tl.load(sink_ptr + heads, mask=row_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / denom[:, None]
    tl.store(o_ptr + tok * (H * D) + heads[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


def _check(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table, sinks):
    name = "attention"
    check_tensor(name, "q", q, 3, rows_strided=True)
    check_tensor(name, "k_cache", k_cache, 4)
    check_tensor(name, "v_cache", v_cache, 4)
    check_tensor(name, "seq_idx", seq_idx, 1, INDEX_DTYPES)
    check_tensor(name, "positions", positions, 1, INDEX_DTYPES)
    Nq, H, D = q.shape
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{name}: k_cache/v_cache dtype ({k_cache.dtype}, {v_cache.dtype}) must equal q dtype {q.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"{name}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    Hkv = k_cache.shape[1]
    if k_cache.shape[3] != D:
        raise ValueError(f"{name}: cache head dim {k_cache.shape[3]} differs from q head dim {D}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"{name}: query heads {H} must be a multiple of KV heads {Hkv}")
    if seq_idx.shape[0] != Nq or positions.shape[0] != Nq:
        raise ValueError(f"{name}: seq_idx [{seq_idx.shape[0]}] and positions [{positions.shape[0]}] must have Nq={Nq} entries")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"{name}: scale must be a float, got {scale!r}")
    check_window(window)
    tensors = [q, k_cache, v_cache, seq_idx, positions]
    if block_table is not None:
        check_tensor(name, "block_table", block_table, 2, INDEX_DTYPES)
        tensors.append(block_table)
    if sinks is not None:
        check_tensor(name, "sinks", sinks, 1)
        if sinks.shape[0] != H:
            raise ValueError(f"{name}: sinks must hold one logit per query head ([{H}]), got {tuple(sinks.shape)}")
        tensors.append(sinks)
    check_device(name, tensors)


def _attention(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table, kv_block, sinks=None):
    Nq, H, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty((Nq, H, D), dtype=q.dtype, device=q.device)
    if Nq == 0 or H == 0:
        return out
    group = H // Hkv
    starts = window_start(positions, window) if window is not None else positions
    paged = block_table is not None
    _attention_kernel[(Nq, Hkv)](
        q, k_cache, v_cache, out, seq_idx, positions, starts, block_table if paged else positions,
        sinks if sinks is not None else q,
        float(scale), q.stride(0), q.stride(1), block_table.stride(0) if paged else 0, k_cache.stride(0), k_cache.stride(1),
        H=H, D=D, GROUP=group,
        HAS_WINDOW=window is not None, PAGED=paged, PAGE_SIZE=k_cache.shape[2] if paged else 1, HAS_SINKS=sinks is not None,
        G_PAD=max(16, next_pow2(group)), BLOCK_D=max(16, next_pow2(D)), KV_BLOCK=kv_block,
        IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_idx: torch.Tensor,
              positions: torch.Tensor, scale: float, window: Optional[int] = None,
              block_table: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal GQA attention of ``q [Nq, H, D]`` against cached keys/values -> ``[Nq, H, D]`` (q's dtype).

    Query i belongs to sequence ``seq_idx[i]`` at position ``positions[i]`` and sees that sequence's keys
    ``window_start(positions[i], window) .. positions[i]``; head h reads KV head ``h // (H // Hkv)``.
    Caches are ``[S, Hkv, L, D]`` (contiguous), or ``[num_blocks, Hkv, block_size, D]`` with
    ``block_table [S, max_blocks]`` mapping key j of sequence s to block ``block_table[s, j // block_size]``,
    slot ``j % block_size``. q needs a contiguous last dim (token/head strides are free); caches must be
    contiguous. Index values are not range-checked on the host (no device sync). ``sinks [H]`` (any float
    dtype, read as fp32): one logit per query head in each row's softmax denominator, no value (gpt-oss).
    """
    _check(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table, sinks)
    return _attention(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table, KV_BLOCK, sinks)

