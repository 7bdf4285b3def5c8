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

Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax denominator and
contributes no value. The shift becomes m = max(row max, sink), and exp(sink - m) is added to sum p after the
blocks (computed on a fixed-width padded tensor, so no element takes a vector loop's scalar tail).

Without autograd (rollout engines, scoring under no_grad) the same arithmetic runs as one C++ pass per tile of
rows (kernels/cpu/attention.cpp: keys and values read straight from the contiguous or paged cache, no gathered
blocks, hidden keys and blocks skipped as the exact zeros they add), where a probe at first use shows it gives
this path's bits for the head size and cache dtype; the training forward keeps the ATen ops below, whose backward
autograd provides. This function is the one place that picks between them.

The arithmetic of a pair and the merge are one core, used by every consistent attention here and in the
context-parallel ring (parallel/context.py, which adds only where a key block's pairs are computed and the
order their partials merge in), and so in a draft's training-time test:
    tile_scores(q, k, bias) -> s;  row_max(m, index, s) -> the shift m;
    tile_partials(s, m rows, with_ones(v), visible) -> [P @ V | sum p];  merge_partials(n, index, partials) ->
    sums in the given order;  tile_output(acc, D, extra) -> out;  tile_weights (p alone: the ring's backward).
The tile height R and the bookkeeping (tile slots, (tile, block) pairs, masks) are in
ops/attention_plan.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.ops.attention_plan import ATTN_TILE_ROWS, KV_BLOCK, AttentionPlan, Padded, Tiled, ones_columns
from nemo_rz.ops.dispatch import by_recomputing, kernel_op, on_gpu_kernels
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.tiles import TILE_ROWS
from nemo_rz.ops.verified import one_thread, verified

__all__ = ["ATTN_TILE_ROWS", "KV_BLOCK", "AttentionPlan", "attention"]
_EXP_FLOOR = -87.0  # exp(-87) ~ 1.6e-38: the smallest inputs whose exp is still a normal float32


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
    plan: AttentionPlan | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """plan: an AttentionPlan for (seq_idx, positions) to reuse across layers (any window); None builds one
    for this call. sinks: [H] logits (any float dtype, used in float32, differentiable) that join each row's
    softmax denominator of query head h and are dropped from the output (gpt-oss); None: no sinks."""
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"attention: sinks must hold one logit per query head ([{q.shape[1]}]), got {tuple(sinks.shape)}")
    if q.shape[0] == 0:
        return q
    if plan is None or not plan.fits(q, k_cache, seq_idx, positions):
        plan = AttentionPlan(seq_idx, positions, q.shape[1], k_cache.shape[1])
    if on_gpu_kernels(q):
        return _attention_kernel(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table, plan, sinks)
    if not consistent():
        return _attention_fast(q, k_cache, v_cache, scale, block_table, plan.padded(window), sinks)
    if _cpp_applies(q, k_cache, v_cache, sinks):
        return _attention_cpp(q, k_cache, v_cache, scale, block_table, plan.starts(window), sinks)
    return _attention_tiled(q, k_cache, v_cache, scale, block_table, plan.tiled(q.shape[-1], torch.float32, window), sinks)


def _attention_kernel(q, k_cache, v_cache, seq_idx, positions, scale, window, block_table, plan, sinks):
    """The Triton kernel; backward: the library attention (SDPA's math backend: deterministic) of the same
    masked softmax in float32, recomputed. Gradients reach q, the caches (the learner's are views of the batch's
    keys and values) and the sinks."""
    from nemo_rz import kernels

    def kernel(q, k, v, s):
        # The kernel reads caches by raw strides: hand it dense ones (the learner's cache is a transposed view).
        return kernels.attention(q, k.contiguous(), v.contiguous(), seq_idx, positions, scale, window, block_table,
                                 sinks=s)

    def reference(q, k, v, s):
        with sdpa_kernel(SDPBackend.MATH):
            out = _attention_fast(q.float(), k.float(), v.float(), scale, block_table, plan.padded(window),
                                  None if s is None else s.float())
        return out.to(q.dtype)

    return kernel_op(kernel, by_recomputing(reference), q, k_cache, v_cache, sinks)


def _cpp_applies(q, k_cache, v_cache, sinks) -> bool:
    """Does this call take the C++ forward? Only without autograd (the learner's training forward keeps the tiled
    path, whose ATen ops have a backward), on CPU, for caches it reads (float32 or bfloat16, unit stride along
    D), and where the probe has shown it gives the tiled path's bits for this head size and cache dtype."""
    tensors = (q, k_cache, v_cache) if sinks is None else (q, k_cache, v_cache, sinks)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu) or k_cache.dtype != v_cache.dtype:
        return False
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return False
    return cpp_verified(q.shape[-1], k_cache.dtype)


def _attention_cpp(q, k_cache, v_cache, scale, block_table, starts, sinks=None):
    """The tiled path's forward in one C++ pass per tile of rows (kernels/cpu/attention.cpp): same bits, no
    gathered key blocks."""
    seq_idx, positions, first = starts
    table = None if block_table is None else block_table.long().contiguous()
    out = cpu_kernels.attention_fwd(q.float().contiguous(), k_cache, v_cache, seq_idx, positions, first, table,
                                    None if sinks is None else sinks.detach().float().contiguous(), float(scale))
    return out if out.dtype == q.dtype else out.to(q.dtype)


def cpp_verified(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Does the C++ forward give the tiled path's bits here, for this head size and cache dtype? Probed once per
    machine and build, the result kept on disk (False without the C++ kernels, NEMO_RZ_CPP=0 or NEMO_RZ_VERIFIED=0):
    decode, chunked and whole prefill, a window, sinks, contiguous and paged caches, on random values, against
    _attention_tiled."""
    ok = _CPP_VERIFIED.get((head_dim, cache_dtype))
    if ok is None:
        tag = cpu_kernels.build_tag()
        if tag is None:
            ok = False
        else:
            # The case's tiled plans are made here: their own probes (tile_rows) must not run inside this one.
            q, caches, calls = _cpp_probe_case(head_dim, cache_dtype)
            # Kept on disk (keyed by the build tag too); a stored True is checked on load with the paged cache's
            # plain causal call alone, a sixth of the probe.
            ok = bool(verified("attention_cpp", (head_dim, str(cache_dtype), tag), lambda: _cpp_agrees(q, caches, calls),
                               check=lambda stored: stored is False
                               or (stored is True and _cpp_agrees(q, caches[1:], calls[:1]))))
        _CPP_VERIFIED[(head_dim, cache_dtype)] = ok
    return ok


_CPP_VERIFIED: dict = {}


def _cpp_probe(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """The probe itself (uncached): does the C++ forward give the tiled path's bits on the probe's case?"""
    return _cpp_agrees(*_cpp_probe_case(head_dim, cache_dtype))


def _cpp_agrees(q, caches, calls) -> bool:
    for window, sink, plan, tiled in calls:
        for kc, vc, bt in caches:
            want = _attention_tiled(q, kc, vc, 0.125, bt, tiled, sink)
            if not torch.equal(_attention_cpp(q, kc, vc, 0.125, bt, plan.starts(window), sink), want):
                return False
    return True


def _cpp_probe_case(head_dim: int, cache_dtype: torch.dtype):
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, slots, block = 6, 2, 96, KV_BLOCK * 2
    lens, new = (70, 33, 9), (1, 20, 9)  # decode, a chunk of prefill, a whole prompt
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(new)])
    positions = torch.cat([torch.arange(length - n, length) for length, n in zip(lens, new)])
    q = torch.randn(seq_idx.shape[0], heads, head_dim, generator=g) * 2.0
    k = torch.randn(len(lens), kv_heads, slots, head_dim, generator=g).to(cache_dtype)
    v = torch.randn(len(lens), kv_heads, slots, head_dim, generator=g).to(cache_dtype)
    # The same keys in a paged cache: blocks of `block` keys in a shuffled order, unused blocks holding NaN.
    per_seq = slots // block + 1
    table = torch.randperm(len(lens) * per_seq + 1, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
    pages = [torch.full((len(lens) * per_seq + 1, kv_heads, block, head_dim), float("nan")).to(cache_dtype) for _ in (k, v)]
    for page, c in zip(pages, (k, v)):
        for s in range(len(lens)):
            for j in range(per_seq):
                n = min(block, slots - j * block)
                if n > 0:
                    page[table[s, j], :, :n] = c[s, :, j * block : j * block + n]
    sinks = torch.randn(heads, generator=g)
    plan = AttentionPlan(seq_idx, positions, heads, kv_heads)
    calls = [(window, sink, plan, plan.tiled(head_dim, torch.float32, window))
             for window, sink in ((None, None), (24, None), (None, sinks))]
    return q, ((k, v, None), (*pages, table)), calls


def _key_blocks(cache: torch.Tensor, t: Tiled, block_table, paged) -> torch.Tensor:
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


def _attention_tiled(q, k_cache, v_cache, scale, block_table, t: Tiled, sinks=None):
    n, heads, dim = q.shape
    R = t.R
    n_pairs = t.pair_tile.shape[0]
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
    s = tile_scores(qp, k, t.bias)
    m = row_max(s.new_full((t.n_tiles, R), float("-inf")), t.p.tile_index, s)
    if sinks is not None:
        sink = sinks.float().index_select(0, t.slot_head.reshape(-1)).view(t.n_tiles, R)  # [T, R]
        with torch.no_grad():
            m = torch.maximum(m, sink)
    pv = tile_partials(s, m.index_select(0, t.pair_tile), with_ones(v), t.visible)
    # A tile's pairs are listed by block: merged in increasing block order.
    acc = merge_partials(t.n_tiles, t.pair_tile, pv)
    extra = None
    if sinks is not None:
        # exp over [T, R, TILE_ROWS] (a whole number of SIMD loop steps), of which column 0 is used.
        shifted = F.pad((sink - m).clamp(min=_EXP_FLOOR).unsqueeze(-1), (0, TILE_ROWS - 1))
        extra = torch.exp(shifted)[..., :1]
    out_t = tile_output(acc, dim, extra)
    out = out_t.reshape(t.n_tiles * R, dim).index_select(0, t.out_rows)[: n * heads].view(n, heads, dim)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _attention_fast(q, k_cache, v_cache, scale, block_table, p: Padded, sinks=None):
    """Library attention: one padded SDPA call over the sequences present (the standard kernel). Sinks: an
    extra key of zeros whose score is set to the sink by the additive mask, with a zero value."""
    n, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    lay = p.lay
    seqs, n_seqs = lay.seqs, lay.seqs.shape[0]
    if lay.single:
        qp = q.unsqueeze(1)
    else:
        qp = q.new_zeros(n_seqs * lay.q_len, heads, dim).index_copy_(0, lay.flat, q).view(n_seqs, lay.q_len, heads, dim)
    if block_table is None:
        if p.k_len <= k_cache.shape[2]:
            k = k_cache[:, :, : p.k_len].index_select(0, seqs)
            v = v_cache[:, :, : p.k_len].index_select(0, seqs)
        else:  # a ring (sliding-window layer): position p at slot p % slots; keys it lost are masked
            slots = torch.arange(p.k_len, device=q.device) % k_cache.shape[2]
            k = k_cache.index_select(0, seqs).index_select(2, slots)
            v = v_cache.index_select(0, seqs).index_select(2, slots)
    else:
        kv_head = torch.arange(kv_heads, device=q.device)
        k = torch.stack([_key_rows(k_cache, seqs, kv_head.new_full((n_seqs,), h), p.key_pos, block_table) for h in range(kv_heads)], 1)
        v = torch.stack([_key_rows(v_cache, seqs, kv_head.new_full((n_seqs,), h), p.key_pos, block_table) for h in range(kv_heads)], 1)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    mask = p.visible
    if sinks is not None:
        k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
        hidden = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        shape = (n_seqs, heads, mask.shape[2])
        mask = torch.cat([hidden.expand(*shape, -1), sinks.to(q.dtype).view(1, heads, 1, 1).expand(*shape, 1)], -1)
    out = F.scaled_dot_product_attention(qp.transpose(1, 2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
    out = out.transpose(1, 2)  # [S, q_len, H, D]
    if lay.single:
        return out.reshape(n, heads, dim)
    return out.reshape(n_seqs * lay.q_len, heads, dim).index_select(0, lay.flat)


# -- the consistent core: partials of (query tile, key block) pairs and their ordered merge ----------------
# ops.attention's consistent path and the context-parallel ring (parallel/context.py) both compute attention
# with these functions; they differ only in which pairs they form and in what order the partials are merged.


def tile_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.bmm on one thread (tile heights vary only where one-thread products were probed: tile_rows), over
    at least two products (a batch of one may take another BLAS path)."""
    if a.shape[0] == 1:
        return tile_bmm(a.expand(2, -1, -1).contiguous(), b.expand(2, -1, -1).contiguous())[:1]
    with one_thread():
        return torch.bmm(a, b)


def tile_scores(q: torch.Tensor, k: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Scores [P, R, KV_BLOCK] of P (query tile, key block) pairs: q [P, R, D] (float32, already scaled) against
    k [P, KV_BLOCK, D] (float32), plus bias [P, R, KV_BLOCK] (0 where a key is visible, -inf where hidden), or
    no bias where every key of every pair is visible."""
    # Keys as contiguous [D, KV_BLOCK] blocks: BLAS takes row-invariant paths only for that layout (verified.py).
    s = tile_bmm(q, k.transpose(1, 2).contiguous())
    return s if bias is None else s + bias


def row_max(m: torch.Tensor, index: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """m with each row's maximum score folded in (scatter_reduce_ "amax" along dim 0 at `index`, shaped like
    s.amax(-1) or flat): the softmax shift, the row's exact maximum visible score, which any order of pairs
    gives. No gradient flows through it (the shift cancels in the softmax)."""
    with torch.no_grad():
        return m.scatter_reduce_(0, index, s.amax(-1).view(index.shape), "amax")


def tile_weights(shifted: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """p = exp(max(shifted, -87)) * visible [P, R, KV_BLOCK] for shifted scores s - (each row's shift).

    exp of -inf or of very negative numbers (denormal results) is many times slower than of ordinary ones: exp
    runs on inputs clamped to >= -87 (results stay normal), and hidden keys are then zeroed exactly by
    `visible` (0/1; None: every key visible). A weight below e^-87 ~ 1.6e-38 becomes 1.6e-38: a fixed function
    of the row, like everything here."""
    p = torch.exp(shifted.clamp(min=_EXP_FLOOR))
    return p if visible is None else p * visible


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """Value blocks [P, KV_BLOCK, D] as [V | 1] [P, KV_BLOCK, D + w] (float32): the appended columns of ones
    give P's row sums in the same product (ones_columns: w makes the width a multiple of 4)."""
    return F.pad(v, (0, ones_columns(v.shape[-1])), value=1.0)


def tile_partials(s: torch.Tensor, shift: torch.Tensor, v1: torch.Tensor, visible: torch.Tensor | None = None) -> torch.Tensor:
    """[P @ V | sum p] [P, R, D + w] of each pair: p = tile_weights(s - shift, visible) with each row's shift
    [P, R], times v1 = with_ones(V) [P, KV_BLOCK, D + w]."""
    return tile_bmm(tile_weights(s - shift.unsqueeze(-1), visible), v1)


def merge_partials(n: int, index: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    """[n, ...]: the partials [P, ...] added into rows index [P] one after another in the order given, starting
    from zeros (index_add_ runs sequentially over P). Callers list each row's pairs in increasing block order;
    a block past a row's position adds exact zeros."""
    return partials.new_zeros(n, *partials.shape[1:]).index_add_(0, index, partials)


def tile_output(acc: torch.Tensor, dim: int, extra: torch.Tensor | None = None) -> torch.Tensor:
    """out [..., D] = (P @ V) / (sum p + extra) of merged partials acc [..., D + w] (extra: the sinks' weights
    [..., 1], or None)."""
    total = acc[..., dim : dim + 1]
    if extra is not None:
        total = total + extra
    return acc[..., :dim] / total
