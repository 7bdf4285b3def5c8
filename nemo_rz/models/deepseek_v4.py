"""DeepSeek-V4 (DeepseekV4ForCausalLM) layers, built only from nemo_rz.ops' consistent arithmetic.

A V4 layer is a pre-norm block over `hc_mult` residual streams (manifold-constrained hyper-connections: the
streams are collapsed by learned `pre` weights before attention / MLP and re-expanded by `post`, the residual
mixed by a doubly stochastic `comb` from Sinkhorn-Knopp), with:

- attention (`DeepseekV4Attention`): low-rank queries (q_a_proj, weighted norm, q_b_proj, then an unweighted
  norm per head), one shared key/value head (kv_proj + norm: the same rotated tensor is key and value), partial
  interleaved RoPE on the trailing `qk_rope_head_dim` dims of each head and its inverse rotation on the output's
  rope slice, per-head sinks, and a grouped low-rank output projection (o_a_proj per head group, o_b_proj).
  Every layer attends a sliding window of `sliding_window` raw keys; `compressed_sparse_attention` (CSA) layers
  also attend compressed entries (one per `compress_rate` tokens, overlapping windows of 2 * rate) chosen per
  query by the lightning indexer (top `index_topk`), `heavily_compressed_attention` (HCA) layers all compressed
  entries (non-overlapping windows) a query may see (entry w is visible from position (w + 1) * rate - 1 on).
- MoE: sqrt(softplus) scores, top-k on scores + e_score_correction_bias (`moe`) or a frozen token-id table
  (`hash_moe`, tid2eid), weights renormalised and times routed_scaling_factor, clamped SwiGLU experts
  (swiglu_limit) and one clamped shared expert.

One arithmetic for every phase. A compressed entry is a fixed function of the projected rows of its window's
tokens (`_emit`: softmax over the window's slots and a weighted sum in slot order, norm, RoPE at the window's
first position); a query's attention is one softmax over [its window's keys | its compressed entries] computed
in KV_BLOCK-key blocks (ops.attention's core: fixed-shape tile products, exact row maximum, blocks merged in
increasing order; blocks no key of the row is in add exact zeros). The learner (dense or packed batches) and
the built-in engine's steps (prefill, decode, chunked prefill) only differ in where the per-position rows live:
this forward's tokens placed per sequence (learner) or the engine's cache (`CompressedState`, written in place),
so a row gets the same bits in every phase and batch.

Indexer tie rule: the top-k is a stable descending sort of float32 scores (ops.route_topk): on equal scores the
lower entry index wins; the chosen entries are then attended in increasing index order.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.layers import MLP, Linear, RMSNorm
from nemo_rz.ops.attention import row_max, tile_output, tile_partials, tile_scores, with_ones
from nemo_rz.ops.delta_rule import pointwise
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.rope import RopeScaling, rope_cos_sin
from nemo_rz.ops.weight_cache import derived

ATTENTION_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
MLP_TYPES = ("hash_moe", "moe")
_EXP_FLOOR = -87.0
_ROWS = ops.ATTN_TILE_ROWS  # query heads per attention tile
_BLOCK = ops.KV_BLOCK


@dataclasses.dataclass(frozen=True)
class V4:
    """The V4-only hyper-parameters (DecoderConfig.deepseek_v4, checked)."""

    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    compress_theta: float
    compress_scaling: RopeScaling | None
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int

    def rate(self, layer: int) -> int | None:
        kind = self.layer_types[layer]
        return {"compressed_sparse_attention": self.csa_rate, "heavily_compressed_attention": self.hca_rate}.get(kind)


KEYS = tuple(f.name for f in dataclasses.fields(V4))


def params(cfg: DecoderConfig) -> V4:
    """cfg's V4 hyper-parameters, checked (one-line errors name the key and what to do)."""
    return _params(cfg.num_layers, cfg.head_dim, cfg.rotary_dim, cfg.q_lora_rank, cfg.num_heads,
                   tuple(sorted((k, _frozen(v)) for k, v in (cfg.deepseek_v4 or {}).items())))


def _frozen(v):
    return tuple(v) if isinstance(v, list) else tuple(sorted(v.items())) if isinstance(v, dict) else v


@functools.lru_cache(maxsize=64)
def _params(layers, head_dim, rotary, q_lora, heads, items) -> V4:
    d = dict(items)
    missing = [k for k in KEYS if k not in d]
    unknown = sorted(set(d) - set(KEYS))
    if missing or unknown:
        raise ValueError(f"DecoderConfig.deepseek_v4: missing {missing} / unknown {unknown} keys; valid keys are {list(KEYS)}")
    scaling = d["compress_scaling"]
    d["compress_scaling"] = None if scaling is None else RopeScaling(**dict(scaling))
    v = V4(**{**d, "layer_types": tuple(d["layer_types"]), "mlp_layer_types": tuple(d["mlp_layer_types"])})
    for name, types, allowed in (("layer_types", v.layer_types, ATTENTION_TYPES), ("mlp_layer_types", v.mlp_layer_types, MLP_TYPES)):
        if len(types) != layers or any(t not in allowed for t in types):
            raise ValueError(f"DecoderConfig.deepseek_v4.{name} = {list(types)}: need one of {', '.join(allowed)} per layer ({layers})")
    for name in ("csa_rate", "hca_rate", "hc_mult", "hc_sinkhorn_iters", "o_groups", "o_lora_rank", "index_n_heads",
                 "index_head_dim", "index_topk"):
        value = getattr(v, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"DecoderConfig.deepseek_v4.{name} = {value!r}: must be a positive integer")
    if heads % v.o_groups:
        raise ValueError(f"DecoderConfig.deepseek_v4.o_groups = {v.o_groups} does not divide num_heads = {heads}")
    if q_lora is None:
        raise ValueError("DecoderConfig.q_lora_rank is None: DeepSeek-V4's queries are low-rank; set q_lora_rank")
    if v.index_head_dim < rotary:
        raise ValueError(f"DecoderConfig.deepseek_v4.index_head_dim = {v.index_head_dim} is below the RoPE width {rotary}")
    return v


# -- small fixed-order pieces ----------------------------------------------------------------------------------
def _unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return ops.rms_norm(x, x.new_ones(x.shape[-1]), eps)


def _sum(xs) -> torch.Tensor:
    """Element-wise sum of the tensors in the order given (one correctly rounded add at a time)."""
    xs = list(xs)
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _padded16(fn, x: torch.Tensor) -> torch.Tensor:
    """fn on x [N, E] with rows zero-padded to a multiple of 16 values: no element lands in a vector loop's tail."""
    pad = (-x.shape[-1]) % 16
    return fn(F.pad(x, (0, pad)))[..., : x.shape[-1]] if pad else fn(x)


def _tables(t, positions: torch.Tensor, rotary: int, theta: float, scaling, key) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved-RoPE (cos, sin) [N, 1, rotary / 2] of `positions` (kept in t.ropes under `key` per forward)."""
    cached = None if key is None or t.ropes is None else t.ropes.get(key)
    if cached is not None:
        return cached
    cos2, sin2 = rope_cos_sin(positions, rotary, theta, scaling)
    out = cos2[..., : rotary // 2], sin2[..., rotary // 2:]
    if key is not None and t.ropes is not None:
        t.ropes[key] = out
    return out


def rotate(x: torch.Tensor, cs: tuple[torch.Tensor, torch.Tensor], inverse: bool = False) -> torch.Tensor:
    """x [N, H, D] with its trailing 2 * cos.shape[-1] dims rotated in adjacent pairs (V4's interleaved RoPE;
    inverse: the conjugate rotation). Only exact IEEE multiplies and adds, in float32."""
    c, s = cs
    rot = 2 * c.shape[-1]
    xf = x.float()
    r = xf[..., -rot:]
    e, o = r[..., 0::2], r[..., 1::2]
    if inverse:
        re, ro = e * c + o * s, o * c - e * s
    else:
        re, ro = e * c - o * s, o * c + e * s
    out = torch.cat([xf[..., :-rot], torch.stack([re, ro], -1).flatten(-2)], -1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


# -- where per-position rows live: this forward's (learner) or the engine's cache ------------------------------
@dataclasses.dataclass
class CompressedState:
    """The built-in engine's per-layer V4 state, beside KVCache.k (the window's rotated keys): the compressors'
    projected rows of each position (`kv`, `gate`; the indexer's `ikv`, `igate`) and the emitted entries
    (`entries`, the indexer's `ientries`), each [num_seqs, slots, width]."""

    rows: dict[int, dict[str, torch.Tensor]]

    @classmethod
    def new(cls, cfg: DecoderConfig, num_seqs: int, max_len: int, device, step_tokens: int | None = None) -> "CompressedState":
        """With `step_tokens` (the most tokens one step writes for a sequence) the per-position rows are a ring of
        step_tokens + 2 * rate - 1 positions (rounded up to KV_BLOCK): the rows of every window a step can close."""
        v, d, dt = params(cfg), cfg.head_dim, cfg.torch_dtype
        out = {}
        for i in range(cfg.num_layers):
            rate = v.rate(i)
            if rate is None:
                continue
            wide = 2 if v.layer_types[i] == "compressed_sparse_attention" else 1
            entries = max_len // rate + 1
            slots = max_len
            if step_tokens is not None:
                ring = step_tokens + 2 * rate - 1
                slots = min(max_len, ring + (-ring) % _BLOCK)
            layer = {"kv": torch.zeros(num_seqs, slots, wide * d, dtype=dt, device=device),
                     "gate": torch.zeros(num_seqs, slots, wide * d, dtype=dt, device=device),
                     "entries": torch.zeros(num_seqs, entries, d, dtype=dt, device=device)}
            if wide == 2:
                hi = v.index_head_dim
                layer.update(ikv=torch.zeros(num_seqs, slots, 2 * hi, dtype=dt, device=device),
                             igate=torch.zeros(num_seqs, slots, 2 * hi, dtype=dt, device=device),
                             ientries=torch.zeros(num_seqs, entries, hi, dtype=dt, device=device))
            out[i] = layer
        return cls(out)


def _engine(t):
    return getattr(t.cache, "compressed", None) if t.cache is not None else None


def _layout(t) -> tuple[int, int]:
    """(sequences, positions per sequence) of a learner forward's per-sequence tensors."""
    if t.cache is None:
        return t.dense
    return t.cache.num_seqs, t.cache.length


def placed(t, x: torch.Tensor) -> torch.Tensor:
    """A learner forward's rows x [N, W] as [S, L, W] per sequence (zeros where no token is)."""
    if t.cache is None:
        b, length = t.dense
        return x.view(b, length, x.shape[-1])
    return t.cache._placed(x.unsqueeze(1), t)[:, 0]  # decoder.BatchKV: shared prefixes read from their rows


def kept(t, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
    """[S, L, W]: the rows of `name` the queries of t may read, position p at p % L (the engine's may be a ring),
    x's written at the tokens of t."""
    state = _engine(t)
    if state is None:
        return placed(t, x)
    buf = state.rows[layer][name]
    buf[t.seq_idx, t.positions % buf.shape[1]] = x.to(buf.dtype)
    return buf


# -- compression ------------------------------------------------------------------------------------------------
def _emit(kv: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, seq: torch.Tensor, bias: torch.Tensor,
          norm: RMSNorm, rate: int, overlap: bool, cs) -> torch.Tensor:
    """Entries [P, D] of windows w [P] of sequences seq [P] from the per-position rows kv / gate [S, L, W]
    (W = 2D with overlap: the previous window's first halves join the window's second halves)."""
    d, slots = kv.shape[-1] // (2 if overlap else 1), kv.shape[1]
    start = w * rate
    slots_kv, slots_gate = [], []
    if overlap:
        prev = (start - rate).clamp(min=0)
        for j in range(rate):
            pos = (prev + j) % slots
            slots_kv.append(kv[seq, pos, :d].float())
            g = gate[seq, pos, :d].float() + bias[j, :d].float()
            slots_gate.append(g.masked_fill((w == 0).unsqueeze(-1), float("-inf")))
    for j in range(rate):
        pos = (start + j) % slots
        slots_kv.append(kv[seq, pos, -d:].float())
        slots_gate.append(gate[seq, pos, -d:].float() + bias[j, -d:].float())
    shift = functools.reduce(torch.maximum, slots_gate)
    e = [pointwise(torch.exp, (g - shift).clamp(min=_EXP_FLOOR)).masked_fill(torch.isinf(g), 0.0) for g in slots_gate]
    total = _sum(e)
    out = _sum(k * (x / total) for k, x in zip(slots_kv, e))
    out = norm(out.to(kv.dtype))
    return rotate(out.unsqueeze(1), cs).squeeze(1)


def _entries(t, layer: int, names: tuple[str, str, str], kv: torch.Tensor, gate: torch.Tensor, bias, norm,
             rate: int, overlap: bool, theta: float, scaling, rotary: int) -> torch.Tensor:
    """[S, E, D]: the compressed entries the queries of t may read (the engine's: emitted as windows close)."""
    kv_all, gate_all = kept(t, layer, names[0], kv), kept(t, layer, names[1], gate)
    state = _engine(t)
    if state is None:
        s, length = kv_all.shape[:2]
        n_w = length // rate
        seq = torch.arange(s, device=kv.device).repeat_interleave(n_w)
        w = torch.arange(n_w, device=kv.device).repeat(s)
    else:
        done = (t.positions + 1) % rate == 0
        seq, w = t.seq_idx[done], torch.div(t.positions[done] + 1, rate, rounding_mode="floor") - 1
    cs = _tables(t, w * rate, rotary, theta, scaling, None)
    out = _emit(kv_all, gate_all, w, seq, bias, norm, rate, overlap, cs) if w.numel() else kv_all.new_zeros(0, norm.weight.shape[0])
    if state is None:
        return out.view(kv_all.shape[0], n_w, out.shape[-1])
    buf = state.rows[layer][names[2]]
    buf[seq, w] = out.to(buf.dtype)
    return buf


class Compressor(nn.Module):
    """kv_proj / gate_proj / position_bias / kv_norm of a CSA (overlapping, 2D-wide rows) or HCA compressor, or of
    the indexer's own (index_head_dim)."""

    def __init__(self, cfg: DecoderConfig, dim: int, rate: int, overlap: bool):
        super().__init__()
        wide = 2 * dim if overlap else dim
        self.rate, self.overlap = rate, overlap
        self.kv_proj = Linear(cfg.hidden_size, wide, False, cfg.torch_dtype)
        self.gate_proj = Linear(cfg.hidden_size, wide, False, cfg.torch_dtype)
        self.position_bias = nn.Parameter(torch.zeros(rate, wide, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, cfg.rms_norm_eps, cfg.torch_dtype)

    def entries(self, x, t, layer: int, names, cfg: DecoderConfig) -> torch.Tensor:
        v = params(cfg)
        return _entries(t, layer, names, self.kv_proj(x), self.gate_proj(x), self.position_bias, self.kv_norm,
                        self.rate, self.overlap, v.compress_theta, v.compress_scaling, cfg.rotary_dim)


class Scorer(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.weights_proj = Linear(cfg.hidden_size, params(cfg).index_n_heads, False, cfg.torch_dtype)


class Indexer(Compressor):
    """The lightning indexer: its own overlapping compressor at index_head_dim, queries q_b_proj(q residual)
    with the compress RoPE, scores sum_h w_h relu(q_h . k) / sqrt(index_head_dim), w = weights_proj(x) /
    sqrt(index_n_heads); each query keeps its index_topk best visible entries (ties: lower index)."""

    def __init__(self, cfg: DecoderConfig):
        v = params(cfg)
        super().__init__(cfg, v.index_head_dim, v.csa_rate, True)
        self.q_b_proj = Linear(cfg.q_lora_rank, v.index_n_heads * v.index_head_dim, False, cfg.torch_dtype)
        self.scorer = Scorer(cfg)

    def select(self, x, q_residual, t, layer: int, cfg: DecoderConfig) -> torch.Tensor:
        """[N, index_topk] entry indices per query, increasing, -1 where fewer entries are visible."""
        v, n = params(cfg), x.shape[0]
        keys = self.entries(x, t, layer, ("ikv", "igate", "ientries"), cfg)  # [S, E, hi]
        q = self.q_b_proj(q_residual).view(n, v.index_n_heads, v.index_head_dim)
        q = rotate(q, _tables(t, t.positions, cfg.rotary_dim, v.compress_theta, v.compress_scaling, ("dsv4", "compress")))
        weights = self.scorer.weights_proj(x).float() * v.index_n_heads ** -0.5  # [N, Hi]
        visible = torch.div(t.positions + 1, v.csa_rate, rounding_mode="floor")  # entries 0..visible-1
        scores = _index_scores(q.float(), keys, t.seq_idx, weights, v.index_head_dim ** -0.5)  # [N, E]
        idx = torch.arange(scores.shape[1], device=x.device)
        hidden = idx[None, :] >= visible[:, None]
        k = v.index_topk
        if scores.shape[1] < k:  # pad: every query's selection has index_topk slots
            scores = F.pad(scores, (0, k - scores.shape[1]))
            hidden = F.pad(hidden, (0, k - hidden.shape[1]), value=True)
        scores = scores.masked_fill(hidden, float("-inf"))
        chosen = torch.sort(scores, dim=1, descending=True, stable=True)[1][:, :k]  # equal scores: lower index first
        chosen = torch.where(chosen < visible[:, None], chosen, -1)
        big = torch.iinfo(chosen.dtype).max
        chosen = torch.sort(torch.where(chosen < 0, big, chosen), dim=1)[0]
        return torch.where(chosen == big, -1, chosen)


def _index_scores(q: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 [N, E]: sum over heads (in order) of weights[n, h] * relu(q[n, h] . keys[seq[n], e]) * scale, each
    dot product a fixed-shape tile product of one query's heads against KV_BLOCK keys."""
    n, heads, dim = q.shape
    e = keys.shape[1]
    if not n or not e:
        return q.new_zeros(n, e)
    if not consistent():
        s = torch.einsum("nhd,ned->nhe", q, keys.float()[seq])
        return (F.relu(s) * scale * weights.unsqueeze(-1)).sum(1)
    blocks = -(-e // _BLOCK)
    k = F.pad(keys.float(), (0, 0, 0, blocks * _BLOCK - e))[seq].view(n * blocks, _BLOCK, dim)
    rows = -(-heads // _ROWS) * _ROWS
    qp = F.pad(q, (0, 0, 0, rows - heads)).view(n, rows // _ROWS, _ROWS, dim)
    qp = qp.unsqueeze(1).expand(n, blocks, rows // _ROWS, _ROWS, dim).reshape(-1, _ROWS, dim)
    kp = k.view(n, blocks, 1, _BLOCK, dim).expand(n, blocks, rows // _ROWS, _BLOCK, dim).reshape(-1, _BLOCK, dim)
    s = tile_scores(qp, kp).view(n, blocks, rows, _BLOCK)[:, :, :heads]  # [N, B, H, BLOCK]
    s = s.permute(0, 2, 1, 3).reshape(n, heads, blocks * _BLOCK)[..., :e]
    return _sum(F.relu(s[:, h]) * scale * weights[:, h: h + 1] for h in range(heads))


# -- attention over [window keys | compressed entries] --------------------------------------------------------
def _attend(q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, D], per-query keys [N, K, D] (K a multiple of KV_BLOCK; values are the keys), visible [N, K]
    bool -> [N, H, D]: one softmax over the visible keys and the head's sink, in KV_BLOCK-key blocks merged in
    increasing order (ops.attention's core)."""
    n, heads, dim = q.shape
    kf = keys.float()
    if not consistent():
        s = torch.einsum("nhd,nkd->nhk", q.float() * scale, kf).masked_fill(~visible[:, None, :], float("-inf"))
        sink = sinks.float().view(1, heads, 1).expand(n, heads, 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
        return torch.einsum("nhk,nkd->nhd", p, kf).to(q.dtype)
    blocks = keys.shape[1] // _BLOCK
    rows = -(-heads // _ROWS) * _ROWS
    tiles = rows // _ROWS
    qs = F.pad(q.float() * scale, (0, 0, 0, rows - heads)).view(n, 1, tiles, _ROWS, dim)
    qp = qs.expand(n, blocks, tiles, _ROWS, dim).reshape(-1, _ROWS, dim)
    kb = kf.view(n, blocks, 1, _BLOCK, dim).expand(n, blocks, tiles, _BLOCK, dim).reshape(-1, _BLOCK, dim)
    vis = visible.view(n, blocks, 1, 1, _BLOCK).expand(n, blocks, tiles, _ROWS, _BLOCK).reshape(-1, _ROWS, _BLOCK)
    s = tile_scores(qp, kb, torch.zeros_like(vis, dtype=torch.float32).masked_fill(~vis, float("-inf")))
    pair_row = torch.arange(n * tiles, device=q.device).view(n, 1, tiles).expand(n, blocks, tiles).reshape(-1)
    m = row_max(s.new_full((n * tiles, _ROWS), float("-inf")), pair_row.view(-1, 1).expand(-1, _ROWS), s)
    sink = F.pad(sinks.float(), (0, rows - heads)).view(1, tiles, _ROWS).expand(n, tiles, _ROWS).reshape(n * tiles, _ROWS)
    with torch.no_grad():
        m = torch.maximum(m, sink)
    pv = tile_partials(s, m.index_select(0, pair_row), with_ones(kb), vis.float())
    pv = pv.view(n, blocks, tiles, _ROWS, -1)
    acc = _sum(pv[:, b] for b in range(blocks)).reshape(n * tiles, _ROWS, -1)
    shifted = F.pad((sink - m).clamp(min=_EXP_FLOOR).unsqueeze(-1), (0, 15))
    out = tile_output(acc, dim, torch.exp(shifted)[..., :1]).view(n, rows, dim)[:, :heads]
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _gather(rows: torch.Tensor, seq: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [S, L, D] at (seq [N], idx [N, k]) padded to `width` slots (zeros, hidden where not ok)."""
    n, k = idx.shape
    got = rows[seq[:, None], idx.clamp(min=0, max=max(rows.shape[1] - 1, 0))] if rows.shape[1] else rows.new_zeros(n, k, rows.shape[-1])
    got = got.masked_fill(~ok.unsqueeze(-1), 0.0)
    return F.pad(got, (0, 0, 0, width - k)), F.pad(ok, (0, width - k), value=False)


class GroupedLinear(nn.Module):
    """o_a_proj: head group g's [H * D / groups] slice through weight rows [g * r, (g + 1) * r) (ops.expert_linear,
    the group as the expert)."""

    def __init__(self, n_in: int, n_out: int, groups: int, dtype):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(nn.init.normal_(torch.empty(n_out, n_in, dtype=dtype), std=0.02))

    def _t(self) -> torch.Tensor:
        w = self.weight
        g = self.groups
        if torch.is_grad_enabled() and w.requires_grad:
            return w.view(g, -1, w.shape[1]).transpose(1, 2).contiguous()
        return derived(w, "dsv4.o_a", lambda: w.detach().view(g, -1, w.shape[1]).transpose(1, 2).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        which = torch.arange(self.groups, device=x.device).repeat(n)
        return ops.expert_linear(x.reshape(n * self.groups, -1), which, self._t(), None).reshape(n, -1)


class DeepseekV4Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        v, dt, h, d = params(cfg), cfg.torch_dtype, cfg.num_heads, cfg.head_dim
        self.cfg, self.layer, self.kind = cfg, layer, v.layer_types[layer]
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, False, dt)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dt)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * d, False, dt)
        self.kv_proj = Linear(cfg.hidden_size, d, False, dt)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        self.o_a_proj = GroupedLinear(h * d // v.o_groups, v.o_groups * v.o_lora_rank, v.o_groups, dt)
        self.o_b_proj = Linear(v.o_groups * v.o_lora_rank, cfg.hidden_size, False, dt)
        self.sinks = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        rate = v.rate(layer)
        if rate is not None:
            self.compressor = Compressor(cfg, d, rate, self.kind == "compressed_sparse_attention")
            if self.kind == "compressed_sparse_attention":
                self.compressor.indexer = Indexer(cfg)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        cfg, v, n = self.cfg, params(self.cfg), x.shape[0]
        h, d = cfg.num_heads, cfg.head_dim
        main = self.kind == "sliding_attention"
        theta, scaling = (cfg.rope_theta, None) if main else (v.compress_theta, v.compress_scaling)
        cs = _tables(t, t.positions, cfg.rotary_dim, theta, scaling, ("dsv4", "main" if main else "compress"))
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = rotate(_unweighted_norm(self.q_b_proj(q_residual).view(n, h, d), cfg.rms_norm_eps), cs)
        kv = rotate(self.kv_norm(self.kv_proj(x)).view(n, 1, d), cs)[:, 0]
        window = cfg.sliding_window
        rows = kept(t, self.layer, "window", kv) if _engine(t) is None else _window_rows(t, self.layer, kv)
        pos = t.positions[:, None] - (window - 1) + torch.arange(window, device=x.device)[None, :]
        wpad = -(-window // _BLOCK) * _BLOCK
        keys, visible = _gather(rows, t.seq_idx, pos.clamp(min=0) % rows.shape[1], pos >= 0, wpad)
        if main:
            pass
        else:
            entries = self.compressor.entries(x, t, self.layer, ("kv", "gate", "entries"), cfg)  # [S, E, D]
            if self.kind == "compressed_sparse_attention":
                idx = self.compressor.indexer.select(x, q_residual, t, self.layer, cfg)
                ok = idx >= 0
            else:
                e = entries.shape[1]
                idx = torch.arange(e, device=x.device).expand(n, e)
                ok = idx < torch.div(t.positions + 1, self.compressor.rate, rounding_mode="floor")[:, None]
            width = -(-idx.shape[1] // _BLOCK) * _BLOCK
            ck, cv = _gather(entries, t.seq_idx, idx, ok, width)
            keys, visible = torch.cat([keys, ck], 1), torch.cat([visible, cv], 1)
        out = _attend(q, keys, visible, self.sinks, d ** -0.5)
        out = rotate(out, cs, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.reshape(n, h * d)))


def _window_rows(t, layer: int, kv: torch.Tensor) -> torch.Tensor:
    """The engine's window keys: KVCache.k[layer] viewed as [S, slots, D] (position p at p % slots: a ring of the
    window and one step's tokens, Decoder.new_cache), written."""
    buf = t.cache.k[layer][:, 0]
    buf[t.seq_idx, t.positions % buf.shape[1]] = kv.to(buf.dtype)
    return buf


# -- MoE ------------------------------------------------------------------------------------------------------------
def _clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return ops.silu_and_mul(gate.clamp(max=limit), up.clamp(min=-limit, max=limit))


class SharedExpert(MLP):
    def __init__(self, cfg: DecoderConfig):
        super().__init__(cfg, cfg.moe_intermediate_size)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_clamped(self.gate_proj(x), self.up_proj(x), self.limit))


class Router(nn.Module):
    def __init__(self, cfg: DecoderConfig, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(nn.init.normal_(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=cfg.torch_dtype), std=0.02))
        if hashed:  # a fresh model's frozen table: token t to experts (t + j) % E (checkpoints bring their own)
            table = torch.arange(cfg.vocab_size)[:, None] + torch.arange(cfg.num_experts_per_tok)[None, :]
            self.register_buffer("tid2eid", table % cfg.num_experts)
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))


def _sqrt_softplus(x: torch.Tensor) -> torch.Tensor:
    if not consistent():
        return F.softplus(x).sqrt()
    return pointwise(lambda r: F.softplus(r).sqrt(), x)


def _routed():
    from nemo_rz.models.moe import _Routed

    return _Routed


class DeepseekV4Moe(_routed()):
    """Hash or top-k routed experts (Qwen3-MoE's stacked layout, clamped SwiGLU) plus the shared expert (a
    moe._Routed: moe.recorded_routing logs its choices)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        from nemo_rz.models.moe import Qwen3MoeExperts

        self.cfg, self.hashed = cfg, params(cfg).mlp_layer_types[layer] == "hash_moe"
        self.gate = Router(cfg, self.hashed)
        self.experts = Qwen3MoeExperts(cfg)
        limit = cfg.swiglu_limit
        self.experts.activation = lambda gu: _clamped(*gu.chunk(2, dim=-1), limit)
        self.shared_experts = SharedExpert(cfg)

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from nemo_rz.models.moe import _row_sum, router_logits

        scores = _sqrt_softplus(router_logits(x, self.gate.weight, None))
        if self.hashed:
            experts = self.gate.tid2eid[ids].long()
        else:
            _, experts = ops.route_topk(scores + self.gate.e_score_correction_bias.float(), self.cfg.num_experts_per_tok)
        weights = scores.gather(1, experts)
        by_index = torch.sort(experts, dim=1, stable=True)[1]  # the sum in increasing expert index
        weights = weights / (_row_sum(weights.gather(1, by_index)) + 1e-20)
        return weights * self.cfg.routed_scaling_factor, experts

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        weights, experts = self.route(x, t.ids)
        if self.routing_log is not None:
            self.routing_log.append(experts.detach().clone())
        return self.experts(x, experts, weights) + self.shared_experts(x)


# -- hyper-connections -----------------------------------------------------------------------------------------
def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [N, n, n] made doubly stochastic: columns, then (rows, columns) iters - 1 times; sums in index order."""
    hc = comb.shape[-1]

    def by_cols(c):
        return c / (_sum(c[:, j: j + 1, :] for j in range(hc)) + eps)

    def by_rows(c):
        return c / (_sum(c[:, :, j: j + 1] for j in range(hc)) + eps)

    comb = by_cols(comb)
    for _ in range(iters - 1):
        comb = by_cols(by_rows(comb))
    return comb


def _collapse(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """sum_j weights[:, j] * streams[:, j] in float32, in stream order, cast to the streams' dtype."""
    return _sum(weights[:, j: j + 1] * streams[:, j].float() for j in range(streams.shape[1])).to(streams.dtype)


class HyperConnection(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        v = params(cfg)
        self.hc, self.iters, self.eps, self.norm_eps = v.hc_mult, v.hc_sinkhorn_iters, v.hc_eps, cfg.rms_norm_eps
        width = (2 + v.hc_mult) * v.hc_mult
        self.fn = nn.Parameter(nn.init.normal_(torch.empty(width, v.hc_mult * cfg.hidden_size), std=0.02))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, hc = streams.shape[0], self.hc
        flat = _unweighted_norm(streams.reshape(n, -1).float(), self.norm_eps)
        mix = ops.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([hc, hc, hc * hc])
        scale = self.scale.float()
        pre = _padded16(ops.sigmoid, pre_w * scale[0] + pre_b) + self.eps
        post = 2 * _padded16(ops.sigmoid, post_w * scale[1] + post_b)
        comb = ops.softmax((comb_w * scale[2] + comb_b).reshape(n * hc, hc)).view(n, hc, hc) + self.eps
        return post, _sinkhorn(comb, self.iters, self.eps), _collapse(pre, streams)


def _expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """streams' [N, n, H]: post[:, k] * out + sum_j comb[:, j, k] * streams[:, j] (in j order), in float32."""
    hc, dt = streams.shape[1], streams.dtype
    o, s = out.float(), streams.float()
    mixed = [_sum(comb[:, j, k: k + 1] * s[:, j] for j in range(hc)) for k in range(hc)]
    return torch.stack([post[:, k: k + 1] * o + mixed[k] for k in range(hc)], 1).to(dt)


class HyperHead(nn.Module):
    """The streams' final collapse before the model norm (`model.hc_head`)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        v = params(cfg)
        self.hc, self.eps, self.norm_eps = v.hc_mult, v.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(nn.init.normal_(torch.empty(v.hc_mult, v.hc_mult * cfg.hidden_size), std=0.02))
        self.hc_base = nn.Parameter(torch.zeros(v.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1).expand(x.shape[0], self.hc, x.shape[1]).contiguous()

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = _unweighted_norm(streams.reshape(streams.shape[0], -1).float(), self.norm_eps)
        mixes = ops.linear(flat, self.hc_fn.float())
        pre = _padded16(ops.sigmoid, mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return _collapse(pre, streams)


class DeepseekV4Block(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        from nemo_rz.models.layers import norm

        self.self_attn = DeepseekV4Attention(cfg, layer)
        self.mlp = DeepseekV4Moe(cfg, layer)
        self.input_layernorm = norm(cfg)
        self.post_attention_layernorm = norm(cfg)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(self, streams: torch.Tensor, t) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = _expand(post, comb, self.self_attn(self.input_layernorm(x), t), streams)
        post, comb, x = self.ffn_hc(streams)
        return _expand(post, comb, self.mlp(self.post_attention_layernorm(x), t), streams)


def cache_elements_per_token(cfg: DecoderConfig) -> dict[str, float]:
    """Cached elements per token per layer type in the built-in engine's layout without rings (keys, the
    compressors' per-position rows and the entries for every position), beside an uncompressed MQA cache's
    head_dim. With new_cache(step_tokens=...) the keys and rows are rings of a fixed size per sequence and only
    the entries (head_dim / rate, index_head_dim / rate) grow with the length."""
    v, d = params(cfg), cfg.head_dim
    hi = v.index_head_dim
    return {"sliding_attention": d,
            "compressed_sparse_attention": d + 4 * d + d / v.csa_rate + 4 * hi + hi / v.csa_rate,
            "heavily_compressed_attention": d + 2 * d + d / v.hca_rate,
            "uncompressed": d}


__all__ = ["CompressedState", "DeepseekV4Attention", "DeepseekV4Block", "DeepseekV4Moe", "HyperHead", "V4", "params",
           "cache_elements_per_token"]
