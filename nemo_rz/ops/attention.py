"""Causal GQA attention over a KV cache.

Layouts: q [N, H, D] for N query tokens from any mix of sequences; contiguous cache [S, Hkv, L, D] indexed by
`seq_idx`, or paged cache [num_blocks, Hkv, block_size, D] with `block_table` [S, max_blocks]. A query at
position p of sequence s sees keys 0..p of s (or the sliding window ending at p). The learner's training
forward is the same call with a cache that holds the whole sequence.

Consistent arithmetic (CPU). Query rows that share keys (same sequence and kv head) are packed, in token
order, into tiles of R rows. Each tile visits the blocks of KV_BLOCK keys 0 .. (its last
position) // KV_BLOCK: one (tile, block) pair each, all pairs of a forward batched into one bmm of
fixed-shape products: scores [R, D] @ [D, KV_BLOCK], then P @ [V | 1] ([R, KV_BLOCK] @ [KV_BLOCK, D + w],
whose extra columns are P's row sums). For each row:
- the softmax shift m is its exact maximum visible score (a max is exact in any order);
- p = exp(max(s - m, -87)) * visible: exact zeros for hidden keys (and exp never sees -inf or an input whose
  result would be denormal, both many times slower);
- its blocks' [P @ V | sum p] are added in increasing block order (`index_add_` runs sequentially over the
  pairs, which are ordered by block within a tile), then out = (P @ V) / sum p.
A block past a row's position adds exact zeros, and nothing depends on the other rows of a tile or on the
other pairs, so a row gives the same bits in decode, prefill, chunked prefill or after a prefix-cache hit,
whatever tile or batch it lands in.

The tile height R: where a probe has shown both batched products row-invariant over R in (4, 8, 16, 32) on this
machine (ops/verified.py), each forward takes the smallest of those that holds its largest group (a decode
step: heads // kv_heads rows per group; a training batch: 32), so decode wastes little and prefill runs few,
larger products. Elsewhere R is fixed at ATTN_TILE_ROWS.

The bookkeeping (which row goes to which tile slot, the pairs, the masks) depends only on the tokens, not on
the layer: `AttentionPlan` computes it once per forward for every layer, and the parts that depend only on
which sequences are present (or on how many blocks each tile has) are cached across decode steps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import TILE_ROWS
from nemo_rz.ops.verified import BMM_ROWS, bmm_verified, one_thread

KV_BLOCK = 32
_EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38: the smallest inputs whose exp is still a normal float32
# Query rows per attention tile where the tile height cannot vary (see above). A decode step has
# `heads // kv_heads` rows per (sequence, kv head), so small tiles waste little.
ATTN_TILE_ROWS = 8


def tile_rows(seq_idx: torch.Tensor, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The tile height R for a forward over these tokens (see the module docstring)."""
    dev = seq_idx.device
    if not (bmm_verified(head_dim, KV_BLOCK, dtype, dev) and bmm_verified(KV_BLOCK, head_dim + _ones_columns(head_dim), dtype, dev)):
        return ATTN_TILE_ROWS
    group = int(torch.bincount(seq_idx).max()) * (heads // kv_heads) if seq_idx.numel() else 1
    return next((r for r in BMM_ROWS if r >= group), BMM_ROWS[-1])


def _ones_columns(head_dim: int) -> int:
    """Columns of ones appended to V (P @ [V | 1] gives P's row sums): 1 to 4, so the width is a multiple of 4
    (BLAS treats the rows of a small product alike only for some column counts: checked on these CPUs)."""
    return 4 - head_dim % 4


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


class _Layout:
    """Which tile slot each query row takes; depends only on the rows' sequences (cached across steps)."""

    def __init__(self, seq_idx: torch.Tensor, heads: int, kv_heads: int, rows: int):
        dev = seq_idx.device
        self.R = R = rows
        rows = seq_idx.shape[0] * heads
        # Row r = token * heads + head belongs to group (sequence, kv head); rows of a group share keys.
        grp = (seq_idx.long()[:, None] * kv_heads + _head_group(heads, kv_heads, dev)).reshape(-1)
        grp_sorted, order = torch.sort(grp, stable=True)  # a group's rows stay in token, head order
        _, grp_rank, counts = torch.unique_consecutive(grp_sorted, return_inverse=True, return_counts=True)
        tiles_per_grp = (counts + (R - 1)) // R
        tile_end = tiles_per_grp.cumsum(0)
        self.n_tiles = int(tile_end[-1])
        # Slot of each sorted row: its group's first tile, then its rank in the group.
        shift = (tile_end - tiles_per_grp) * R - (counts.cumsum(0) - counts)
        slot = torch.arange(rows, device=dev) + shift[grp_rank]
        self.slot = slot
        self.order = order
        self.token_of_sorted = order // heads
        # Padding slots compute query row 0 at position 0: finite (key 0 of the tile's sequence is always
        # there), and it adds no key block (every tile visits block 0). Their outputs are dropped.
        self.src = torch.zeros(self.n_tiles * R, dtype=torch.long, device=dev).index_copy_(0, slot, order)
        self.row_slot = torch.empty_like(slot).index_copy_(0, order, slot)
        # Output rows padded up to whole row tiles of tokens (the padding repeats slot 0), so that the next
        # op (o_proj) finds its row tiles already there (see tiles.to_tiles).
        tokens = seq_idx.shape[0]
        padded_rows = (tokens + (-tokens) % TILE_ROWS) * heads
        self.out_rows = F.pad(self.row_slot, (0, padded_rows - rows)) if padded_rows > rows else self.row_slot
        self.tile_grp = grp[self.src.view(self.n_tiles, R)[:, 0]]  # a tile's first slot is always a real row
        self.pairs: dict = {}  # tuple(blocks per tile) -> _Pairs


_LAYOUTS: dict = {}


def _layout(seq_idx: torch.Tensor, heads: int, kv_heads: int, rows: int) -> _Layout:
    """The layout for these sequences; the last few are kept, as decode steps repeat the same sequences."""
    key = (tuple(seq_idx.tolist()), heads, kv_heads, rows, str(seq_idx.device))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= 8:  # a small cache; clear() is safe even if another thread uses it
            _LAYOUTS.clear()
        layout = _LAYOUTS[key] = _Layout(seq_idx, heads, kv_heads, rows)
    return layout


class _Pairs:
    """The (tile, key block) pairs for a layout and a number of blocks per tile (cached: it changes only
    when a tile's last position crosses a block boundary)."""

    def __init__(self, lay: "_Layout", tile_nb: torch.Tensor):
        dev = tile_nb.device
        R, T = lay.R, lay.n_tiles
        pair_tile = torch.arange(T, device=dev).repeat_interleave(tile_nb)
        n_pairs = pair_tile.shape[0]
        pair_j = torch.arange(n_pairs, device=dev) - (tile_nb.cumsum(0) - tile_nb)[pair_tile]
        self.real = n_pairs
        if n_pairs == 1:  # a batch of one product may take another BLAS path: always run at least two
            pair_tile, pair_j = pair_tile.repeat(2), pair_j.repeat(2)
        self.pair_tile, self.pair_j = pair_tile, pair_j
        self.tile_index = pair_tile[:n_pairs, None].expand(n_pairs, R)  # scatter index of the real pairs
        self.pair_grp = lay.tile_grp[pair_tile]
        self.q_src = lay.src.view(T, R)[pair_tile].reshape(-1)  # [P * R] rows of q, tile by tile
        self.block_start = (pair_j * KV_BLOCK)[:, None]
        self._block_index: dict[int, torch.Tensor] = {}

    def block_index(self, blocks_per_seq_head: int) -> torch.Tensor:
        """Index of each pair's key block in a contiguous cache viewed as [S * Hkv * L / KV_BLOCK, KV_BLOCK, D]."""
        idx = self._block_index.get(blocks_per_seq_head)
        if idx is None:
            idx = self._block_index[blocks_per_seq_head] = self.pair_grp * blocks_per_seq_head + self.pair_j
        return idx


_MASK_TABLES: dict = {}


def _mask_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """([KV_BLOCK + 2, KV_BLOCK] bias, same-shape 0/1 visibility): row d + 1 sees key offsets <= d (d = -1 ..
    KV_BLOCK), with bias 0 there and -inf after."""
    key = str(device)
    tables = _MASK_TABLES.get(key)
    if tables is None:
        hidden = torch.arange(KV_BLOCK, device=device) > torch.arange(-1, KV_BLOCK + 1, device=device)[:, None]
        bias = torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))
        tables = _MASK_TABLES[key] = (bias, (~hidden).float())
    return tables


class _Tiled:
    """Tile layout of one forward's query rows and the (tile, key block) pairs they visit (consistent path)."""

    def __init__(self, seq_idx: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, window, rows: int):
        lay = _layout(seq_idx, heads, kv_heads, rows)
        T = lay.n_tiles
        self.R, self.n_tiles, self.out_rows, self._kv_heads = rows, T, lay.out_rows, kv_heads
        pos_t = positions.new_zeros(T * rows, dtype=torch.long)
        pos_t = pos_t.index_copy_(0, lay.slot, positions.long().index_select(0, lay.token_of_sorted)).view(T, rows)
        tile_last = pos_t.amax(1)
        tile_nb = tile_last // KV_BLOCK + 1
        key = tuple(tile_nb.tolist())
        pairs = lay.pairs.get(key)
        if pairs is None:
            if len(lay.pairs) >= 4:
                lay.pairs.clear()
            pairs = lay.pairs[key] = _Pairs(lay, tile_nb)
        self.p = pairs
        self.pair_tile, self.real = pairs.pair_tile, pairs.real
        # Visible keys of each (pair, row): offsets 0 .. pos - block start (and, with a window, from the
        # window start on): one table row per (pair, row).
        pos_p = pos_t.index_select(0, pairs.pair_tile)
        bias_table, visible_table = _mask_tables(pos_t.device)
        row = (pos_p - pairs.block_start).clamp_(-1, KV_BLOCK).add_(1)
        shape = (*row.shape, KV_BLOCK)
        if window is None:  # [P, R, KV_BLOCK]
            self.bias = bias_table.index_select(0, row.view(-1)).view(shape)
            self.visible = visible_table.index_select(0, row.view(-1)).view(shape)
        else:
            # Keys at offsets <= window start - 1 - block start are before the window.
            before = (_window_start(pos_p, window) - 1 - pairs.block_start).clamp_(-1, KV_BLOCK).add_(1)
            self.visible = visible_table.index_select(0, row.view(-1)).view(shape) * (
                1.0 - visible_table.index_select(0, before.view(-1)).view(shape))
            self.bias = torch.zeros_like(self.visible).masked_fill_(self.visible == 0, float("-inf"))
        self._tile_last = tile_last

    def paged(self):
        """(sequence, kv head, key positions [P, KV_BLOCK], keys past the tile's last row [P, KV_BLOCK, 1])."""
        p = self.p
        key_pos = p.block_start + torch.arange(KV_BLOCK, device=p.pair_j.device)
        past = (key_pos > self._tile_last[p.pair_tile, None]).unsqueeze(-1)
        return p.pair_grp // self._kv_heads, p.pair_grp % self._kv_heads, key_pos, past


_HEAD_GROUP: dict = {}


def _head_group(heads: int, kv_heads: int, device) -> torch.Tensor:
    """[heads]: the kv head each query head reads (cached)."""
    key = (heads, kv_heads, str(device))
    t = _HEAD_GROUP.get(key)
    if t is None:
        t = _HEAD_GROUP[key] = torch.arange(heads, device=device) // (heads // kv_heads)
    return t


class _PadLayout:
    """Padded-batch layout of tokens: sequence s's tokens in rows s * q_len + 0, 1, ... (cached across steps)."""

    def __init__(self, seq_idx: torch.Tensor):
        dev = seq_idx.device
        n = seq_idx.shape[0]
        self.seqs, inv = torch.unique(seq_idx.long(), return_inverse=True)
        order = torch.argsort(inv * (n + 1) + torch.arange(n, device=dev))
        counts = torch.bincount(inv, minlength=len(self.seqs))
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[inv[order]]
        self.q_len = int(counts.max())
        self.flat = inv * self.q_len + rank
        # One token per sequence, sequences in increasing order (a decode step): the batch is already padded.
        self.single = self.q_len == 1 and bool((inv == torch.arange(n, device=dev)).all())


_PAD_LAYOUTS: dict = {}


class _Padded:
    """Padded-batch layout of one forward's query rows (fast path: one SDPA call)."""

    def __init__(self, seq_idx: torch.Tensor, positions: torch.Tensor, window):
        key = (tuple(seq_idx.tolist()), str(seq_idx.device))
        lay = _PAD_LAYOUTS.get(key)
        if lay is None:
            if len(_PAD_LAYOUTS) >= 8:
                _PAD_LAYOUTS.clear()
            lay = _PAD_LAYOUTS[key] = _PadLayout(seq_idx)
        self.lay = lay
        n_seqs, q_len = lay.seqs.shape[0], lay.q_len
        self.k_len = int(positions.max()) + 1
        positions = positions.long()
        if lay.single:
            pos_p = positions.view(n_seqs, 1)
        else:
            pos_p = positions.new_zeros(n_seqs * q_len).index_copy_(0, lay.flat, positions).view(n_seqs, q_len)
        key_pos = torch.arange(self.k_len, device=positions.device)
        self.visible = key_pos <= pos_p[:, None, :, None]  # [S, 1, q_len, k_len]
        if window is not None:
            self.visible &= key_pos >= _window_start(pos_p, window)[:, None, :, None]
        self.key_pos = key_pos.unsqueeze(0).expand(n_seqs, -1)


class AttentionPlan:
    """Bookkeeping for one forward's attention calls, computed on first use and shared by all layers."""

    def __init__(self, seq_idx: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, window: int | None = None):
        self.seq_idx, self.positions = seq_idx, positions
        self.heads, self.kv_heads, self.window = heads, kv_heads, window
        self._tiled = self._padded = None

    def fits(self, q, k_cache, seq_idx, positions, window) -> bool:
        return (seq_idx is self.seq_idx and positions is self.positions and window == self.window
                and q.shape[1] == self.heads and k_cache.shape[1] == self.kv_heads)

    def tiled(self, head_dim: int, dtype: torch.dtype) -> _Tiled:
        if self._tiled is None:
            rows = tile_rows(self.seq_idx, self.heads, self.kv_heads, head_dim, dtype)
            self._tiled = _Tiled(self.seq_idx, self.positions, self.heads, self.kv_heads, self.window, rows)
        return self._tiled

    @property
    def padded(self) -> _Padded:
        if self._padded is None:
            self._padded = _Padded(self.seq_idx, self.positions, self.window)
        return self._padded


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_idx: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
    block_table: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """plan: an AttentionPlan for (seq_idx, positions) to reuse across layers; None builds one for this call."""
    if q.shape[0] == 0:
        return q
    if on_gpu_kernels(q):
        from nemo_rz import kernels

        # The kernel reads caches by raw strides: hand it dense ones (the learner's cache is a transposed view).
        return kernels.attention(q, k_cache.contiguous(), v_cache.contiguous(), seq_idx, positions, scale, window, block_table)
    if plan is None or not plan.fits(q, k_cache, seq_idx, positions, window):
        plan = AttentionPlan(seq_idx, positions, q.shape[1], k_cache.shape[1], window)
    if not consistent():
        return _attention_fast(q, k_cache, v_cache, scale, block_table, plan.padded)
    return _attention_tiled(q, k_cache, v_cache, scale, block_table, plan.tiled(q.shape[-1], torch.float32))


def _key_blocks(cache: torch.Tensor, t: _Tiled, block_table, paged) -> torch.Tensor:
    """[P, KV_BLOCK, D]: the key (or value) block of each (tile, block) pair, as float32."""
    if paged is None:
        blocks = cache.contiguous().view(-1, KV_BLOCK, cache.shape[-1])
        idx = t.p.block_index(cache.shape[2] // KV_BLOCK)
        # Same values either way; index_select is the fast gather, indexing has the fast backward.
        out = blocks[idx] if blocks.requires_grad and torch.is_grad_enabled() else blocks.index_select(0, idx)
    else:
        seqs, kv_heads, key_pos, _ = paged
        out = _paged_blocks(cache, seqs, kv_heads, key_pos[:, 0], block_table)
        if out is None:
            out = _key_rows(cache, seqs, kv_heads, key_pos, block_table)
    return out if out.dtype == torch.float32 else out.float()


def _paged_blocks(cache, seqs, kv_heads, block_start, block_table) -> torch.Tensor | None:
    """[P, KV_BLOCK, D] by whole-block gathers from a paged cache [num_blocks, Hkv, block_size, D] (any strides
    that keep each KV_BLOCK keys of a head one contiguous run, as vLLM's CPU layout does); None otherwise."""
    _, _, block_size, dim = cache.shape
    unit = KV_BLOCK * dim
    s0, s1, s2, s3 = cache.stride()
    offset = cache.storage_offset()
    if block_size % KV_BLOCK or s3 != 1 or s2 != dim or s0 % unit or s1 % unit or offset % unit:
        return None
    phys = block_table[seqs, torch.div(block_start, block_size, rounding_mode="floor")].long()
    start = offset + phys * s0 + kv_heads.long() * s1 + (block_start % block_size) * dim
    units = cache.untyped_storage().nbytes() // (cache.element_size() * unit)
    return cache.as_strided((units, KV_BLOCK, dim), (unit, dim, 1), 0).index_select(0, torch.div(start, unit, rounding_mode="floor"))


def _attention_tiled(q, k_cache, v_cache, scale, block_table, t: _Tiled):
    n, heads, dim = q.shape
    R = t.R
    n_pairs, real = t.pair_tile.shape[0], t.real  # pairs past `real` pad a one-pair batch
    paged = t.paged() if block_table is not None or k_cache.shape[2] % KV_BLOCK else None
    qs = q.reshape(n * heads, dim).float() * scale
    qp = qs.index_select(0, t.p.q_src).view(n_pairs, R, dim)
    k = _key_blocks(k_cache, t, block_table, paged)
    v = _key_blocks(v_cache, t, block_table, paged)
    if paged is not None:
        # A paged cache may hold garbage (even NaN) past the tile's last key: make it zero, so that hidden
        # keys score exactly -inf below and contribute 0 * 0. (A contiguous cache holds only values the
        # model wrote, or zeros, so there adding -inf hides a key exactly.)
        past = paged[3]
        k, v = k.masked_fill(past, 0.0), v.masked_fill(past, 0.0)
    # Keys as contiguous [D, KV_BLOCK] blocks: BLAS takes row-invariant paths only for that layout (verified.py).
    with one_thread():  # tile heights vary only where one-thread products were probed (tile_rows)
        s = torch.bmm(qp, k.transpose(1, 2).contiguous()) + t.bias
    with torch.no_grad():  # the shift cancels in the softmax; no gradient flows through it
        s_max = s.amax(-1)
        m = s_max.new_full((t.n_tiles, R), float("-inf"))
        m.scatter_reduce_(0, t.p.tile_index, s_max[:real] if real < n_pairs else s_max, "amax")
    # exp of -inf or of very negative numbers (denormal results) is many times slower than of ordinary ones:
    # exp runs on inputs clamped to >= -87 (results stay normal), and hidden keys are then zeroed exactly.
    # A weight below e^-87 ~ 1.6e-38 becomes 1.6e-38: a fixed function of the row, like everything here.
    p = torch.exp((s - m.index_select(0, t.pair_tile).unsqueeze(-1)).clamp(min=_EXP_FLOOR)) * t.visible
    # P @ [V | 1 ...]: the appended columns of ones give the row sums of P in the same product.
    with one_thread():
        pv = torch.bmm(p, F.pad(v, (0, _ones_columns(dim)), value=1.0))  # [P, R, D + w]
    # Sum over a tile's blocks in increasing block order (index_add_ adds the pairs one after another).
    acc = pv.new_zeros(t.n_tiles, R, pv.shape[-1]).index_add_(0, t.pair_tile[:real], pv[:real] if real < n_pairs else pv)
    out_t = acc[..., :dim] / acc[..., dim : dim + 1]
    out = out_t.reshape(t.n_tiles * R, dim).index_select(0, t.out_rows)[: n * heads].view(n, heads, dim)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _attention_fast(q, k_cache, v_cache, scale, block_table, p: _Padded):
    """Library attention: one padded SDPA call over the sequences present (the standard kernel)."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    lay = p.lay
    seqs, n_seqs = lay.seqs, lay.seqs.shape[0]
    if lay.single:
        qp = q.unsqueeze(1)
    else:
        qp = q.new_zeros(n_seqs * lay.q_len, heads, dim).index_copy_(0, lay.flat, q).view(n_seqs, lay.q_len, heads, dim)
    if block_table is None:
        k = k_cache[:, :, : p.k_len].index_select(0, seqs)
        v = v_cache[:, :, : p.k_len].index_select(0, seqs)
    else:
        kv_head = torch.arange(kv_heads, device=q.device)
        k = torch.stack([_key_rows(k_cache, seqs, kv_head.new_full((n_seqs,), h), p.key_pos, block_table) for h in range(kv_heads)], 1)
        v = torch.stack([_key_rows(v_cache, seqs, kv_head.new_full((n_seqs,), h), p.key_pos, block_table) for h in range(kv_heads)], 1)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=p.visible, scale=scale)
    out = out.transpose(1, 2)  # [S, q_len, H, D]
    if lay.single:
        return out.reshape(n, heads, dim)
    return out.reshape(n_seqs * lay.q_len, heads, dim).index_select(0, lay.flat)
