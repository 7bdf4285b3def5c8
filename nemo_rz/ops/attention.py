"""Causal GQA attention over a KV cache.

Layouts: q [N, H, D] for N query tokens from any mix of sequences; contiguous cache [S, Hkv, L, D] indexed by
`seq_idx`, or paged cache [num_blocks, Hkv, block_size, D] with `block_table` [S, max_blocks]. A query at
position p of sequence s sees keys 0..p of s (or the sliding window ending at p). The learner's training
forward is the same call with a cache that holds the whole sequence.

Consistent arithmetic: each query row runs an online softmax over keys in blocks of KV_BLOCK, in increasing
order, with scores and P@V as fixed-shape products of a TILE_ROWS-row query tile. Blocks past a row's
position contribute exact zeros, so a row gives the same bits in decode, prefill, chunked prefill or after a
prefix-cache hit, whatever tile or batch it lands in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import TILE_ROWS, row_sum

KV_BLOCK = 32


def _window_start(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    if window is None:
        return torch.zeros_like(positions)
    from nemo_rz.kernels.window import window_start

    return window_start(positions, window)


def _key_rows(cache, seqs, kv_heads, key_pos, block_table):
    """Gather cache rows: seqs/kv_heads [A], key_pos [A, K] -> [A, K, D]."""
    if block_table is None:
        return cache[seqs[:, None], kv_heads[:, None], key_pos]
    block_size = cache.shape[2]
    phys = block_table[seqs[:, None], torch.div(key_pos, block_size, rounding_mode="floor")]
    return cache[phys, kv_heads[:, None], key_pos % block_size]


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    if q.shape[0] == 0:
        return q
    if not consistent():
        return _attention_fast(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table)
    if on_gpu_kernels(q):
        from nemo_rz import kernels

        return kernels.attention(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table)
    return _attention_tiled(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table)


def _attention_tiled(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table):
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    dev = q.device
    R = TILE_ROWS

    # One row per (token, head); rows sharing (sequence, kv head) share keys, so they share tiles.
    head = torch.arange(heads, device=dev).repeat(n)
    tok = torch.arange(n, device=dev).repeat_interleave(heads)
    grp = seq_idx.long()[tok] * kv_heads + head // group
    order = torch.argsort(grp * (n * heads) + torch.arange(n * heads, device=dev))
    grp_sorted = grp[order]
    uniq, counts = torch.unique_consecutive(grp_sorted, return_counts=True)
    first_row = torch.cumsum(counts, 0) - counts
    tiles_per_grp = (counts + R - 1) // R
    first_tile = torch.cumsum(tiles_per_grp, 0) - tiles_per_grp
    grp_rank = torch.repeat_interleave(torch.arange(len(uniq), device=dev), counts)
    rank = torch.arange(n * heads, device=dev) - first_row[grp_rank]
    slot_in_all = (first_tile[grp_rank] + rank // R) * R + rank % R
    n_tiles = int(tiles_per_grp.sum())

    q_rows = q.reshape(n * heads, dim).float()[order]
    qt = q_rows.new_zeros(n_tiles * R, dim).index_copy(0, slot_in_all, q_rows).view(n_tiles, R, dim)
    pos_rows = positions.long()[tok][order]
    pos_t = torch.zeros(n_tiles * R, dtype=torch.long, device=dev).index_copy(0, slot_in_all, pos_rows)
    pos_t = pos_t.view(n_tiles, R)
    tile_grp = torch.repeat_interleave(uniq, tiles_per_grp)
    tile_seq, tile_kv = tile_grp // kv_heads, tile_grp % kv_heads
    # Tiles are processed longest first so that the tiles still active at block j are a prefix.
    n_blocks = pos_t.amax(dim=1) // KV_BLOCK + 1
    by_len = torch.argsort(n_blocks, descending=True, stable=True)
    qt, pos_t, tile_seq, tile_kv, n_blocks = qt[by_len], pos_t[by_len], tile_seq[by_len], tile_kv[by_len], n_blocks[by_len]
    start_t = _window_start(pos_t, window)
    active_per_block = torch.bincount(n_blocks - 1, minlength=int(n_blocks[0])).flip(0).cumsum(0).flip(0).tolist()

    m = qt.new_full((n_tiles, R), float("-inf"))
    l = qt.new_zeros(n_tiles, R)
    acc = qt.new_zeros(n_tiles, R, dim)
    offsets = torch.arange(KV_BLOCK, device=dev)
    for j, a in enumerate(active_per_block):
        key_pos = (j * KV_BLOCK + offsets).unsqueeze(0).expand(a, -1)
        k = _key_rows(k_cache, tile_seq[:a], tile_kv[:a], key_pos, block_table).float()
        v = _key_rows(v_cache, tile_seq[:a], tile_kv[:a], key_pos, block_table).float()
        # Keys past every row of the tile may be uninitialised cache: zero them so 0 * v stays 0.
        v = torch.where((key_pos <= pos_t[:a].amax(1, keepdim=True)).unsqueeze(-1), v, 0.0)
        s = torch.bmm(qt[:a], k.transpose(1, 2)) * scale
        kp = key_pos.unsqueeze(1)
        hidden = (kp > pos_t[:a].unsqueeze(-1)) | (kp < start_t[:a].unsqueeze(-1))
        s = s.masked_fill(hidden, float("-inf"))
        m_new = torch.maximum(m[:a], s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows that have seen no key yet
        p = torch.exp(s - m_safe.unsqueeze(-1))
        alpha = torch.exp(m[:a] - m_safe)
        l_new = l[:a] * alpha + row_sum(p).squeeze(-1)
        acc_new = acc[:a] * alpha.unsqueeze(-1) + torch.bmm(p, v)
        m = torch.cat([m_new, m[a:]])
        l = torch.cat([l_new, l[a:]])
        acc = torch.cat([acc_new, acc[a:]])

    out_t = (acc / l.unsqueeze(-1)).view(n_tiles * R, dim)
    unsorted = torch.empty(n_tiles, dtype=torch.long, device=dev)
    unsorted[by_len] = torch.arange(n_tiles, device=dev)
    tile_of_slot = slot_in_all // R
    rows_sorted = out_t.view(n_tiles, R, dim)[unsorted[tile_of_slot], slot_in_all % R]
    rows = torch.empty_like(rows_sorted).index_copy(0, order, rows_sorted)
    return rows.view(n, heads, dim).to(q.dtype)


def _attention_fast(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table):
    """Library attention: one padded SDPA call over the sequences present (the standard kernel)."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    seqs, inv = torch.unique(seq_idx.long(), return_inverse=True)
    order = torch.argsort(inv * (n + 1) + torch.arange(n, device=q.device))
    counts = torch.bincount(inv, minlength=len(seqs))
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=q.device) - (torch.cumsum(counts, 0) - counts)[inv[order]]
    q_len, k_len = int(counts.max()), int(positions.max()) + 1
    qp = q.new_zeros(len(seqs), q_len, heads, dim)
    qp[inv, rank] = q
    pos_p = torch.zeros(len(seqs), q_len, dtype=torch.long, device=q.device)
    pos_p[inv, rank] = positions.long()
    key_pos = torch.arange(k_len, device=q.device).unsqueeze(0).expand(len(seqs), -1)
    kv_head = torch.arange(kv_heads, device=q.device)
    if block_table is None:
        k = k_cache[seqs, :, :k_len]
        v = v_cache[seqs, :, :k_len]
    else:
        k = torch.stack([_key_rows(k_cache, seqs, kv_head.new_full((len(seqs),), h), key_pos, block_table) for h in range(kv_heads)], 1)
        v = torch.stack([_key_rows(v_cache, seqs, kv_head.new_full((len(seqs),), h), key_pos, block_table) for h in range(kv_heads)], 1)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    kp = key_pos[:, None, None, :]
    visible = (kp <= pos_p[:, None, :, None]) & (kp >= _window_start(pos_p, window)[:, None, :, None])
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=visible, scale=scale)
    return out.transpose(1, 2)[inv, rank]
