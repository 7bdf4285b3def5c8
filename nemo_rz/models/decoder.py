"""A decoder-only transformer built only from nemo_rz.ops, composed per layer from the blocks in
models/layers.py (attention: full, sliding window, sinks; MLP: dense or mixture of experts, models/moe.py).

Parameter names follow Hugging Face's layout (`model.layers.0.self_attn.q_proj.weight`...), so checkpoints
load without renaming. One forward serves both sides:
- the learner: `token_logprobs(input_ids, lengths, mask=...)` runs the batch's valid tokens, packed (no padding
  rows; a prefix several sequences share, such as a group's prompt, once: Packing), with autograd, and the LM
  head only at the positions the loss reads, in chunks (ops.lm_head_logprobs);
- the rollout engine: `step(ids, positions, seq_idx, cache)` runs any mix of prefill and decode tokens and
  writes their keys/values into a KV cache.
Both end in the same ops, so for the same weights and tokens they compute the same bits (in consistent mode).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.layers import MLP, Attention, Block, Linear, RMSNorm, block, embed_scale, forward_layout, laid_out_like, norm
from nemo_rz.protocols import KVCacheProtocol

__all__ = ["Attention", "Block", "Decoder", "KVCache", "Linear", "MLP", "Packing", "RMSNorm", "Tokens", "packed_rows",
           "prepared", "unpacked"]


_KV_HEAD_OFFSETS: dict = {}


def _kv_head_offsets(kv_heads: int, max_len: int, device) -> torch.Tensor:
    """[kv_heads] row offsets of each kv head in a cache viewed as [S * Hkv * L, D] (cached)."""
    key = (kv_heads, max_len, device)
    t = _KV_HEAD_OFFSETS.get(key)
    if t is None:
        t = _KV_HEAD_OFFSETS[key] = torch.arange(kv_heads, device=device) * max_len
    return t


@dataclasses.dataclass
class KVCache:
    """The built-in engine's cache: per-layer keys and values [num_seqs, num_kv_heads, slots, head_dim] (slots a
    multiple of KV_BLOCK), row `seq_idx` for a sequence, the key of position p at slot p % slots.

    A full-attention layer has a slot for every position (`max_len`); a sliding-window layer may have fewer: a
    ring that keeps the last window's keys and those of the tokens one step writes (Decoder.new_cache). A key
    the window no longer sees may be overwritten: its slot is masked out (exact zero weight) wherever it is read.
    A multi-head latent attention model (models/mla.py) caches one latent row per token, [num_seqs, 1, slots,
    kv_lora_rank + head_dim], held once: `v[layer] is k[layer]`.

    Any `nemo_rz.protocols.KVCacheProtocol` (write the new tokens' keys/values, view what `ops.attention` reads)
    can serve as `Tokens.cache`; the vLLM backend passes one over vLLM's paged cache.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    length: int | None = None  # positions served per sequence (None: the first layer's slots)
    windows: list[int | None] | None = None  # each layer's attention window (None: full), for the prefix cache
    linear: dict | None = None  # {layer: models.linear_attention.LinearState} of a hybrid model's linear layers
    compressed: object | None = None  # DeepSeek-V4's compressors' state (models.deepseek_v4.CompressedState)

    @property
    def max_len(self) -> int:
        return self.length or self.k[0].shape[2]

    def rows(self, t: "Tokens") -> dict[int, torch.Tensor] | None:
        """{slots: where each token's key/value rows go in a layer with that many slots, viewed as
        [S * Hkv * slots, D]} (None: not contiguous)."""
        if not all(k.is_contiguous() for k in self.k):
            return None
        kv_heads, seq, pos = self.k[0].shape[1], t.seq_idx.long()[:, None], t.positions.long()[:, None]
        out = {}
        for slots in {k.shape[2] for k in self.k}:
            row = seq * (kv_heads * slots) + (pos % slots if slots < self.max_len else pos)
            out[slots] = (row + _kv_head_offsets(kv_heads, slots, row.device)).view(-1)
        return out

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, t: "Tokens") -> None:
        k_all, v_all = self.k[layer], self.v[layer]
        slots, shared = k_all.shape[2], v_all is k_all  # shared: one latent tensor (multi-head latent attention)
        if t.cache_rows is None:
            pos = t.positions % slots if slots < self.max_len else t.positions
            k_all[t.seq_idx, :, pos] = k.to(k_all.dtype)
            if not shared:
                v_all[t.seq_idx, :, pos] = v.to(v_all.dtype)
        else:
            dim, rows = k.shape[-1], t.cache_rows[slots]
            k_all.view(-1, dim).index_copy_(0, rows, k.reshape(-1, dim).to(k_all.dtype))
            if not shared:
                v_all.view(-1, dim).index_copy_(0, rows, v.reshape(-1, dim).to(v_all.dtype))

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.k[layer], self.v[layer], None


@dataclasses.dataclass
class Tokens:
    """A flat batch of query tokens: which sequence each belongs to and at what position."""

    ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    seq_idx: torch.Tensor  # [N]
    cache: KVCacheProtocol | None = None  # None: a dense [B, T] learner batch, its own cache
    dense: tuple[int, int] | None = None
    attend: Callable | None = None  # (q, k, v, scale) -> out, in place of ops.attention (context parallelism)
    # Per-forward values shared by the layers (filled in by Decoder.hidden):
    plan: ops.AttentionPlan | None = None  # attention bookkeeping (one for every window)
    ropes: dict | None = None  # (theta, scaling) -> rotation of each position (ops.rope_cos_sin)
    cache_rows: dict | None = None  # {layer slots: [N * Hkv] rows} a KVCache writes (KVCache.rows)


class BatchKV:
    """The learner's keys/values of a packed batch (Decoder.packed): each layer's [S, Hkv, L, D] view, L the
    longest sequence rounded up to KV_BLOCK, built from the forward's own tokens (differentiable), zeros past
    each sequence's end. A query sees only its own sequence's earlier positions, so the zeros get exact zero
    weight, as the padding of a dense batch does.

    With `where` ([S, T], a Packing's) a sequence's keys at shared positions are read from the rows that ran them
    (a prefix it shares with another sequence runs once); without it each token is its own sequence's key."""

    def __init__(self, num_seqs: int, length: int, where: torch.Tensor | None = None):
        self.num_seqs, self.length = num_seqs, length + (-length) % ops.KV_BLOCK
        self.where = where
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def _placed(self, x: torch.Tensor, t: "Tokens") -> torch.Tensor:
        if self.where is None:
            out = x.new_zeros(self.num_seqs, self.length, *x.shape[1:])
            return out.index_put((t.seq_idx, t.positions), x).transpose(1, 2)
        rows = F.pad(self.where[:, : self.length], (0, self.length - min(self.length, self.where.shape[1])), value=-1)
        zero = x.new_zeros(1, *x.shape[1:])  # what padding reads: row N
        out = torch.cat([x, zero]).index_select(0, rows.reshape(-1).where(rows.reshape(-1) >= 0, x.shape[0]))
        return out.view(self.num_seqs, self.length, *x.shape[1:]).transpose(1, 2)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, t: "Tokens") -> None:
        self.k[layer] = self._placed(k, t)
        self.v[layer] = self.k[layer] if v is k else self._placed(v, t)  # (a latent layer: one tensor for both)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.k[layer], self.v[layer], None


def packed_rows(lengths: torch.Tensor, length: int) -> torch.Tensor:
    """[sum(lengths)]: where each valid token of a padded [B, length] batch (the first lengths[i] of row i) sits
    in the flat [B * length] layout, in row order (the packed layout without shared prefixes)."""
    return (torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]).reshape(-1).nonzero().squeeze(1)


def unpacked(x: torch.Tensor, lengths: torch.Tensor, length: int, fill: float = 0.0) -> torch.Tensor:
    """Rows of the packed layout [sum(lengths), ...] -> the padded [B * length, ...] one, `fill` at padding."""
    rows = packed_rows(lengths.to(x.device), length)
    return x.new_full((lengths.shape[0] * length, *x.shape[1:]), fill).index_put((rows,), x)


@dataclasses.dataclass(frozen=True)
class Packing:
    """The tokens of a padded [B, T] batch that one learner forward runs: each valid position once, except that
    a position whose tokens up to and including it equal another sequence's (a GRPO group's shared prompt, a
    common system prompt) runs once for all of them. A position's hidden state depends only on the tokens up
    to it, and every op is row-invariant, so a shared row has the bits each sequence's own row would have had.

    rows [N]: the flat position b * T + t of each row the forward runs, in row order (b, then t);
    where [B, T]: the row that position (b, t) reads, -1 past the sequence's end."""

    rows: torch.Tensor
    where: torch.Tensor

    @classmethod
    def of(cls, input_ids: torch.Tensor, lengths: torch.Tensor) -> "Packing":
        b, length = input_ids.shape
        dev = input_ids.device
        lengths = lengths.to(dev)
        ar = torch.arange(length, device=dev)
        valid = ar[None, :] < lengths[:, None]
        shared = torch.zeros(b, dtype=torch.long, device=dev)  # each row's prefix run by the row before it in `order`
        order = sorted(range(b), key=[r[:n] for r, n in zip(input_ids.tolist(), lengths.tolist())].__getitem__)
        if b > 1:  # in lexicographic order a row's longest common prefix with any other is with its predecessor
            prev, cur = torch.tensor(order[:-1], device=dev), torch.tensor(order[1:], device=dev)
            same = (input_ids[prev] == input_ids[cur]) & valid[prev] & valid[cur]
            shared[cur] = torch.cat([~same, same.new_ones(b - 1, 1)], 1).int().argmax(1)
        own = valid & (ar[None, :] >= shared[:, None])
        where = torch.where(own, own.reshape(-1).cumsum(0).view(b, length) - 1, -1)
        for p, c in zip(order, order[1:]):  # shared positions read their predecessor's rows (already resolved)
            n = int(shared[c])
            where[c, :n] = where[p, :n]
        return cls(own.reshape(-1).nonzero().squeeze(1), where)

    def unpack(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Rows of this packing [N, ...] -> the padded [B * T, ...] layout, `fill` past each sequence's end."""
        where = self.where.reshape(-1).to(x.device)
        out = torch.cat([x, x.new_full((1, *x.shape[1:]), fill)])
        return out.index_select(0, where.where(where >= 0, x.shape[0]))


def prepared(cfg: DecoderConfig, t: Tokens, heads: int | None = None, kv_heads: int | None = None) -> Tokens:
    """t with what every layer's attention shares filled in: the attention plan (for `heads` / `kv_heads` query and
    key heads: the model's, or one tensor-parallel rank's), each RoPE's rotation of the positions, the cache rows."""
    return dataclasses.replace(
        t,
        plan=t.plan or ops.AttentionPlan(t.seq_idx, t.positions, heads or cfg.num_heads, kv_heads or cfg.num_kv_heads),
        ropes=t.ropes or {r: ops.rope_cos_sin(t.positions, cfg.head_dim, r[0], r[1])
                          for r in dict.fromkeys(cfg.rope(i) for i in range(cfg.num_layers))},
        cache_rows=t.cache.rows(t) if t.cache_rows is None and isinstance(t.cache, KVCache) else t.cache_rows,
    )


class Body(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=cfg.torch_dtype)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        if cfg.tie_word_embeddings:  # also the LM head: in the Linear weight layout, its own GEMM operand (no copy)
            self.embed_tokens.weight = nn.Parameter(laid_out_like(self.embed_tokens.weight, forward_layout(
                cfg.vocab_size, cfg.hidden_size, cfg.torch_dtype), cfg.torch_dtype))
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg)
        if cfg.attention_kind == "deepseek_v4":  # the layers run on hc_mult streams: expanded here, collapsed by it
            from nemo_rz.models.deepseek_v4 import HyperHead

            self.hc_head = HyperHead(cfg)


class Decoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = Body(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, cfg.torch_dtype)

    # -- shared core -------------------------------------------------------------------------------
    def hidden(self, t: Tokens) -> torch.Tensor:
        """Final-norm hidden states [N, hidden] of the tokens in t."""
        cfg = self.config
        if t.ids.numel():
            lo, hi = torch.aminmax(t.ids)
            if int(lo) < 0 or int(hi) >= cfg.vocab_size:
                raise ValueError(
                    f"token id out of range [0, {cfg.vocab_size}) in the model input: "
                    "check the tokenizer matches the model's vocab_size"
                )
        t = prepared(cfg, t)
        x = ops.embedding(t.ids, self.model.embed_tokens.weight)
        if cfg.embed_scale:
            x = x * embed_scale(cfg).to(x.device)
        streams = getattr(self.model, "hc_head", None)
        if streams is not None:
            x = streams.expand(x)
        for layer in self.model.layers:
            x = layer(x, t)
        return self.model.norm(x if streams is None else streams(x))

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's [vocab, hidden] weight (the embedding's, when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.linear(hidden, self.head_weight)

    # -- learner path ------------------------------------------------------------------------------
    def tokens(self, input_ids: torch.Tensor) -> Tokens:
        """A padded [B, T] batch as the Tokens every layer reads (positions, sequence ids, the attention plan)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        b, length = input_ids.shape
        dev = input_ids.device
        positions = torch.arange(length, device=dev).repeat(b)
        seq_idx = torch.arange(b, device=dev).repeat_interleave(length)
        return Tokens(input_ids.reshape(-1), positions, seq_idx, None, (b, length))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] for a dense batch."""
        b, length = input_ids.shape
        return self.logits(self.hidden(self.tokens(input_ids))).view(b, length, -1)

    def packing(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> Packing:
        """What a forward of the padded [B, T] batch runs (the first lengths[i] tokens of row i, shared prefixes
        once): a Packing, after checking `lengths`."""
        b, length = input_ids.shape
        lengths = lengths.to(input_ids.device)
        if lengths.shape != (b,) or (b and (int(lengths.min()) < 1 or int(lengths.max()) > length)):
            raise ValueError(f"lengths {lengths.tolist()} must hold one length in 1..{length} per row of the "
                             f"[{b}, {length}] input_ids; pass each sequence's token count")
        return Packing.of(input_ids, lengths)

    def packed(self, input_ids: torch.Tensor, lengths: torch.Tensor, packing: Packing | None = None) -> Tokens:
        """The rows of a padded [B, T] batch's Packing (its valid tokens, a prefix shared by several sequences
        once) with their positions and sequence ids: no padding rows reach the layers."""
        b, length = input_ids.shape
        packing = packing or self.packing(input_ids, lengths)
        rows = packing.rows
        longest = int(lengths.max()) if b else 0
        return Tokens(input_ids.reshape(-1)[rows], rows % length, rows // length, BatchKV(b, longest, packing.where))

    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, temperature: float = 1.0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [B, T-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) at `temperature`; 0 past each length and,
        with `mask` [B, T-1], wherever it is 0 (the LM head runs only where it is not). With `lengths` the layers
        run the batch's Packing (valid tokens only, shared prefixes once), without it the whole [B, T] batch; the
        bits are the same."""
        b, length = input_ids.shape
        dev = input_ids.device
        if mask is not None and mask.shape != (b, length - 1):
            raise ValueError(f"token_logprobs: mask is {tuple(mask.shape)} but input_ids {tuple(input_ids.shape)} "
                             f"needs [{b}, {length - 1}] (one entry per predicted token)")
        want = torch.ones(b, length - 1, dtype=torch.bool, device=dev)
        if lengths is None:
            hidden = self.hidden(self.tokens(input_ids))
            row = torch.arange(b * length, device=dev).view(b, length)  # the hidden row of each position
        else:
            lengths = lengths.to(dev)
            packing = self.packing(input_ids, lengths)
            hidden = self.hidden(self.packed(input_ids, lengths, packing))
            want &= torch.arange(length - 1, device=dev)[None, :] < (lengths[:, None] - 1)
            row = packing.where
        if mask is not None:
            want &= mask.to(dev) != 0
        where = want.reshape(-1).nonzero().squeeze(1)
        seq, pos = where // max(length - 1, 1), where % max(length - 1, 1)
        lp = ops.lm_head_logprobs(hidden.index_select(0, row[seq, pos]), self.head_weight, input_ids[seq, pos + 1],
                                  temperature)
        return lp.new_zeros(b * (length - 1)).index_put((where,), lp).view(b, length - 1)

    # -- rollout path ------------------------------------------------------------------------------
    def new_cache(self, num_seqs: int, max_len: int, device=None, step_tokens: int | None = None) -> KVCache:
        """Keys/values for `num_seqs` sequences of up to `max_len` tokens. With `step_tokens` (the most tokens one
        engine step writes for a sequence), a sliding-window layer keeps a ring of window - 1 + step_tokens
        positions (rounded up to KV_BLOCK) instead of max_len: the keys its queries can still see. On CUDA every
        layer keeps max_len (the Triton attention reads keys by position)."""
        cfg = self.config
        max_len += (-max_len) % ops.KV_BLOCK
        dev = torch.device(device) if device is not None else self.model.embed_tokens.weight.device

        def slots(window: int | None, layer: int) -> int:
            if cfg.is_linear(layer):  # no keys: its state is a LinearState (never read or written as keys)
                return ops.KV_BLOCK
            if window is None or step_tokens is None or dev.type == "cuda":
                return max_len
            ring = window - 1 + step_tokens
            return min(max_len, ring + (-ring) % ops.KV_BLOCK)

        v4 = cfg.attention_kind == "deepseek_v4"  # one shared key/value row per token, and compressors' state
        latent = cfg.attention_kind == "mla" or v4  # one latent row per token (models/mla.py): keys and values alike
        dim = cfg.kv_lora_rank + cfg.head_dim if latent else cfg.head_dim
        shapes = [(num_seqs, cfg.num_kv_heads, slots(w, i), dim) for i, w in enumerate(cfg.windows())]
        def make():
            return [torch.zeros(shape, dtype=cfg.torch_dtype, device=dev) for shape in shapes]

        k = make()
        linear = None
        if any(cfg.is_linear(i) for i in range(cfg.num_layers)):
            from nemo_rz.models.linear_attention import LinearState

            linear = {i: LinearState.new(cfg, num_seqs, dev) for i in range(cfg.num_layers) if cfg.is_linear(i)}
        compressed = None
        if v4:
            from nemo_rz.models.deepseek_v4 import CompressedState

            compressed = CompressedState.new(cfg, num_seqs, max_len, dev, None if dev.type == "cuda" else step_tokens)
        return KVCache(k, list(k) if latent else make(), max_len, cfg.windows(), linear, compressed)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, seq_idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run query tokens of any mix of sequences against (and into) `cache`; returns hidden [N, hidden]."""
        return self.hidden(Tokens(ids, positions, seq_idx, cache))
