"""Attention bookkeeping: which query row goes to which tile slot, the (tile, key block) pairs, the masks.

All of it depends only on the tokens (sequences and positions), not on the layer: `AttentionPlan` computes it
once per forward for every layer, and the parts that depend only on which sequences are present (or on how many
blocks each tile has) are kept across decode steps in small bounded caches. The arithmetic that uses the plan
is in ops/attention.py.

The tile height R: where a probe has shown both batched products row-invariant over R in (4, 8, 16, 32) on this
machine (ops/verified.py), each forward takes the smallest of those that holds its largest group (a decode
step: heads // kv_heads rows per group; a training batch: 32), so decode wastes little and prefill runs few,
larger products. Elsewhere R is fixed at ATTN_TILE_ROWS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.tiles import TILE_ROWS
from nemo_rz.ops.verified import BMM_ROWS, bmm_verified

KV_BLOCK = 32
# Query rows per attention tile where the tile height cannot vary (see above). A decode step has
# `heads // kv_heads` rows per (sequence, kv head), so small tiles waste little.
ATTN_TILE_ROWS = 8


class BoundedCache:
    """A few values computed from their key and kept for reuse (decode steps repeat the same bookkeeping).
    When full it is cleared rather than ordered: cheap, and safe for a reader in another thread."""

    def __init__(self, size: int):
        self.size, self._values = size, {}

    def get(self, key, make):
        value = self._values.get(key)
        if value is None:
            if len(self._values) >= self.size:
                self._values.clear()
            value = self._values[key] = make()
        return value


def tile_rows(seq_idx: torch.Tensor, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The tile height R for a forward over these tokens (see the module docstring)."""
    dev = seq_idx.device
    if not (bmm_verified(head_dim, KV_BLOCK, dtype, dev) and bmm_verified(KV_BLOCK, head_dim + ones_columns(head_dim), dtype, dev)):
        return ATTN_TILE_ROWS
    group = int(torch.bincount(seq_idx).max()) * (heads // kv_heads) if seq_idx.numel() else 1
    return next((r for r in BMM_ROWS if r >= group), BMM_ROWS[-1])


def ones_columns(head_dim: int) -> int:
    """Columns of ones appended to V (P @ [V | 1] gives P's row sums): 1 to 4, so the width is a multiple of 4
    (BLAS treats the rows of a small product alike only for some column counts: checked on these CPUs)."""
    return 4 - head_dim % 4


def _window_start(positions: torch.Tensor, window: int | None) -> torch.Tensor:
    if window is None:
        return torch.zeros_like(positions)
    from nemo_rz.kernels.window import window_start

    return window_start(positions, window)


def _head_group(heads: int, kv_heads: int, device) -> torch.Tensor:
    """[heads]: the kv head each query head reads."""
    return _HEAD_GROUPS.get((heads, kv_heads, str(device)), lambda: torch.arange(heads, device=device) // (heads // kv_heads))


def _mask_tables(device) -> tuple[torch.Tensor, torch.Tensor]:
    """([KV_BLOCK + 2, KV_BLOCK] bias, same-shape 0/1 visibility): row d + 1 sees key offsets <= d (d = -1 ..
    KV_BLOCK), with bias 0 there and -inf after."""

    def make():
        hidden = torch.arange(KV_BLOCK, device=device) > torch.arange(-1, KV_BLOCK + 1, device=device)[:, None]
        return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf")), (~hidden).float()

    return _MASK_TABLES.get(str(device), make)


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
        self.slot_head = (self.src % heads).view(self.n_tiles, R)  # the query head of each slot (for sinks)
        self.pairs = BoundedCache(4)  # tuple(blocks per tile) -> _Pairs


def _layout(seq_idx: torch.Tensor, heads: int, kv_heads: int, rows: int) -> _Layout:
    """The layout for these sequences; the last few are kept, as decode steps repeat the same sequences."""
    key = (tuple(seq_idx.tolist()), heads, kv_heads, rows, str(seq_idx.device))
    return _LAYOUTS.get(key, lambda: _Layout(seq_idx, heads, kv_heads, rows))


class _Pairs:
    """The (tile, key block) pairs for a layout and a number of blocks per tile (cached: it changes only
    when a tile's last position crosses a block boundary)."""

    def __init__(self, lay: "_Layout", tile_nb: torch.Tensor):
        dev = tile_nb.device
        R, T = lay.R, lay.n_tiles
        pair_tile = torch.arange(T, device=dev).repeat_interleave(tile_nb)
        n_pairs = pair_tile.shape[0]
        pair_j = torch.arange(n_pairs, device=dev) - (tile_nb.cumsum(0) - tile_nb)[pair_tile]
        self.pair_tile, self.pair_j = pair_tile, pair_j
        self.tile_index = pair_tile[:, None].expand(n_pairs, R)  # scatter index of the pairs' rows
        self.pair_grp = lay.tile_grp[pair_tile]
        self.q_src = lay.src.view(T, R)[pair_tile].reshape(-1)  # [P * R] rows of q, tile by tile
        self.block_start = (pair_j * KV_BLOCK)[:, None]
        self._block_index = BoundedCache(4)  # blocks per (sequence, kv head) -> index

    def block_index(self, blocks_per_seq_head: int) -> torch.Tensor:
        """Index of each pair's key block in a contiguous cache viewed as [S * Hkv * L / KV_BLOCK, KV_BLOCK, D]. A
        cache with fewer slots than positions is a ring (block j at slot block j % blocks): the keys it no longer
        holds are outside the window, masked wherever they are read."""
        return self._block_index.get(blocks_per_seq_head,
                                     lambda: self.pair_grp * blocks_per_seq_head + self.pair_j % blocks_per_seq_head)


class Tiled:
    """Tile layout of one forward's query rows and the (tile, key block) pairs they visit (consistent path)."""

    def __init__(self, seq_idx: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, window, rows: int):
        lay = _layout(seq_idx, heads, kv_heads, rows)
        T = lay.n_tiles
        self.R, self.n_tiles, self.out_rows, self._kv_heads = rows, T, lay.out_rows, kv_heads
        self.slot_head = lay.slot_head
        pos_t = positions.new_zeros(T * rows, dtype=torch.long)
        pos_t = pos_t.index_copy_(0, lay.slot, positions.long().index_select(0, lay.token_of_sorted)).view(T, rows)
        tile_last = pos_t.amax(1)
        tile_nb = tile_last // KV_BLOCK + 1
        pairs = lay.pairs.get(tuple(tile_nb.tolist()), lambda: _Pairs(lay, tile_nb))
        self.p = pairs
        self.pair_tile = pairs.pair_tile
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


class Padded:
    """Padded-batch layout of one forward's query rows (fast path: one SDPA call)."""

    def __init__(self, seq_idx: torch.Tensor, positions: torch.Tensor, window):
        self.lay = lay = _PAD_LAYOUTS.get((tuple(seq_idx.tolist()), str(seq_idx.device)), lambda: _PadLayout(seq_idx))
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
    """Bookkeeping for one forward's attention calls, computed on first use and shared by all layers. The
    masks depend on each call's window and are kept per window, so sliding-window and full layers share one
    plan. (The `window` argument is accepted for older callers and not used: every call names its window.)"""

    def __init__(self, seq_idx: torch.Tensor, positions: torch.Tensor, heads: int, kv_heads: int, window: int | None = None):
        self.seq_idx, self.positions = seq_idx, positions
        self.heads, self.kv_heads = heads, kv_heads
        self._tiled, self._padded, self._starts = {}, {}, {}

    def fits(self, q, k_cache, seq_idx, positions) -> bool:
        """Is this the plan for these tokens and head counts?"""
        return (seq_idx is self.seq_idx and positions is self.positions
                and q.shape[1] == self.heads and k_cache.shape[1] == self.kv_heads)

    def tiled(self, head_dim: int, dtype: torch.dtype, window: int | None) -> Tiled:
        key = (window, head_dim, dtype)
        if key not in self._tiled:
            rows = tile_rows(self.seq_idx, self.heads, self.kv_heads, head_dim, dtype)
            self._tiled[key] = Tiled(self.seq_idx, self.positions, self.heads, self.kv_heads, window, rows)
        return self._tiled[key]

    def starts(self, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seq_idx, positions, each token's first visible key), int64 and contiguous: the C++ forward's
        bookkeeping (it tiles the rows itself)."""
        if window not in self._starts:
            positions = self.positions.long().contiguous()
            self._starts[window] = (self.seq_idx.long().contiguous(), positions,
                                    _window_start(positions, window).contiguous())
        return self._starts[window]

    def padded(self, window: int | None) -> Padded:
        if window not in self._padded:
            self._padded[window] = Padded(self.seq_idx, self.positions, window)
        return self._padded[window]


# Kept across forwards: sequence layouts (decode steps repeat them), and per-device/shape constants.
_LAYOUTS = BoundedCache(8)
_PAD_LAYOUTS = BoundedCache(8)
_HEAD_GROUPS = BoundedCache(16)
_MASK_TABLES = BoundedCache(4)
