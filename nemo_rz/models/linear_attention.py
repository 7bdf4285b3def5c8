"""Linear-attention layers of hybrid models: Gated DeltaNet (Qwen3-Next, `linear_attn`), Kimi Delta Attention
(Kimi Linear, `self_attn`: KimiDeltaAttention), and the gated full attention of Qwen3-Next (output gate, partial
RoPE). Both linear layers are a DeltaRuleMixer: the same conv, cache and delta rule, their own projections,
gates and output.

Gated DeltaNet, as transformers' Qwen3NextGatedDeltaNet (parameter names alike): `in_proj_qkvz` (per key head:
q, k, then the value and gate heads of its group), `in_proj_ba`, a causal depthwise `conv1d` (kernel K) + SiLU on
[q, k, v], beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), l2-normalised q and k (q scaled by
Dk^-0.5), the gated delta rule (ops/delta_rule.py), the gated RMSNorm (`norm`: weight * rms-normalised, times
SiLU(z)) and `out_proj`.

One arithmetic on every site (ops/delta_rule.py explains the chunk-synchronised scheme). Whatever the call, the
layer lays each sequence's tokens out by absolute position: the conv reads each token's K-1 predecessors (the
cache's pre-conv rows for those before the call, zeros before position 0) and sums its K taps in a fixed order
in float32; the delta rule runs over whole-chunk tiles from the chunk that holds the call's first token. So the
learner (a dense or packed batch, with its shared prefixes), prefill, chunked prefill and decode compute the
same bits for a token.

The per-sequence cache (LinearState, one per linear layer, beside the KV cache, float32 throughout): the state S
[slots, Hv, Dk, Dv] at the sequence's last chunk boundary, the inputs (q, k, v, g, beta after the conv and
norms) of its current partial chunk [slots, Hv, CHUNK, *], and the last K-1 pre-conv rows [slots, K-1, conv_dim].
Deviation from transformers: beta's sigmoid is taken in float32 (transformers takes it in the model dtype:
identical in float32, a bfloat16 rounding apart in bfloat16; vLLM also uses float32).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.layers import Linear, attend_rotated, norm
from nemo_rz.ops.delta_rule import CHUNK, chunk_tiles, l2norm, pointwise


@dataclasses.dataclass
class LinearState:
    """One linear-attention layer's cache for `slots` sequences (see the module docstring)."""

    state: torch.Tensor  # [slots, Hv, Dk, Dv]
    q: torch.Tensor  # [slots, Hv, CHUNK, Dk]  the partial chunk's inputs (rows past its last token are zero)
    k: torch.Tensor
    v: torch.Tensor  # [slots, Hv, CHUNK, Dv]
    g: torch.Tensor  # [slots, Hv, CHUNK] (Gated DeltaNet) or [slots, Hv, CHUNK, Dk] (Kimi Delta Attention)
    beta: torch.Tensor
    conv: torch.Tensor  # [slots, K-1, conv_dim]: the pre-conv rows of the K-1 positions before the next token

    @classmethod
    def new(cls, cfg: DecoderConfig, slots: int, device) -> "LinearState":
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        def z(*shape):
            return torch.zeros(*shape, dtype=torch.float32, device=device)
        gate = (dk,) if cfg.linear_kind == "kda" else ()  # one gate per key channel (KDA) or per head
        return cls(z(slots, hv, dk, dv), z(slots, hv, CHUNK, dk), z(slots, hv, CHUNK, dk), z(slots, hv, CHUNK, dv),
                   z(slots, hv, CHUNK, *gate), z(slots, hv, CHUNK), z(slots, cfg.linear_conv_kernel_dim - 1, conv_dim(cfg)))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def copy_slot(self, src: int, dst: int) -> None:
        """Sequence `dst` continues from where `src` stands (a twin fork)."""
        for t in self.tensors():
            t[dst] = t[src]

    def reset(self, slot: int) -> None:
        for t in self.tensors():
            t[slot].zero_()

    def nbytes_per_sequence(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors())


def conv_dim(cfg: DecoderConfig) -> int:
    return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim


class _Conv(nn.Module):
    """The depthwise conv's weight, transformers' Conv1d layout [channels, 1, K] (no bias)."""

    def __init__(self, channels: int, kernel: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype))
        nn.init.normal_(self.weight, std=kernel ** -0.5)


class GatedNorm(nn.Module):
    """weight * rms_norm(x) times act(gate) in float32: the weight applied in x's dtype and SiLU (transformers'
    Qwen3NextRMSNormGated), or with `float_weight` x and the weight in float32 and `gate` another activation
    (Kimi Linear's KimiLinearRMSNormGated: sigmoid)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, gate=F.silu, float_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps, self.act, self.float_weight = eps, gate, float_weight

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.float_weight:
            y = ops.rms_norm(x.float(), self.weight.float(), self.eps)
        else:
            y = ops.rms_norm(x, self.weight, self.eps).float()
        return (y * pointwise(self.act, gate.float())).to(x.dtype)


def _layout(t, n: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """How a call's rows sit per sequence: (table [S, L]: the row holding each sequence's local position l, -1
    past its end; the sequence of each row [N]; each row's local position [N]; each sequence's first position
    [S]; the cache slot of each sequence [S] or None for a learner batch)."""
    from nemo_rz.models.decoder import BatchKV

    seq, pos = t.seq_idx.long(), t.positions.long()
    if t.cache is None or isinstance(t.cache, BatchKV):
        if t.cache is not None and t.cache.where is not None:  # a Packing: shared prefixes read their owner's rows
            where = t.cache.where.to(device)
            length = int(where.ge(0).sum(1).max()) if where.numel() else 0
            table = where[:, :length].long()
        else:
            s = int(seq.max()) + 1 if n else 0
            length = int(pos.max()) + 1 if n else 0
            table = torch.full((s, length), -1, dtype=torch.long, device=device).index_put_((seq, pos), torch.arange(n, device=device))
        return table, seq, pos, torch.zeros(table.shape[0], dtype=torch.long, device=device), None
    slots, inverse = torch.unique(seq, return_inverse=True)
    s = slots.shape[0]
    first = torch.full((s,), torch.iinfo(torch.long).max, dtype=torch.long, device=device).scatter_reduce(0, inverse, pos, "amin")
    local = pos - first[inverse]
    count = torch.zeros(s, dtype=torch.long, device=device).index_add_(0, inverse, torch.ones_like(pos))
    if n and bool((torch.zeros_like(count).scatter_reduce(0, inverse, local, "amax") + 1 != count).any()):
        raise ValueError("linear attention: each sequence's tokens in one step must be consecutive positions, each once")
    table = torch.full((s, int(count.max()) if n else 0), -1, dtype=torch.long, device=device)
    table.index_put_((inverse, local), torch.arange(n, device=device))
    return table, inverse, local, first, slots


def _dense(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows x [N, ...] -> [S, L, ...] by `table` (zeros where it is -1)."""
    padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])
    idx = table.reshape(-1)
    return padded.index_select(0, idx.where(idx >= 0, x.shape[0])).view(*table.shape, *x.shape[1:])


class DeltaRuleMixer(nn.Module):
    """What Gated DeltaNet and Kimi Delta Attention share: the causal conv over [q, k, v] by absolute position,
    l2-normalised q (scaled by Dk^-0.5) and k, the chunk-synchronised delta rule (ops/delta_rule.py) with its
    cache, and each row's core output [N, Hv, Dv]. A layer gives its projections (`project`: the conv's input
    rows and its own per-row values), its gates (`gates`: g and beta, float32, in the [S, L, ...] layout) and
    its output (`output`)."""

    hf_name = "self_attn"  # transformers' module name of the layer (Block)
    l2_divide = False  # ops/delta_rule.l2norm's form

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        raise NotImplementedError

    def gates(self, side: tuple, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def output(self, core: torch.Tensor, side: tuple) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        cfg, n, dev = self.cfg, x.shape[0], x.device
        if t.attend is not None:
            raise ValueError("linear attention layers do not run under context parallelism; use cp_size=1 for this model")
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kern = cfg.linear_conv_kernel_dim
        mixed, side = self.project(x)  # mixed [N, conv_dim]: the conv's input rows [q, k, v]
        table, seq, local, first, slots = _layout(t, n, dev)
        cache = None if slots is None else t.cache.linear[self.layer]
        s, length = table.shape
        valid = table >= 0
        counts = valid.sum(1)

        # -- causal conv: K taps over the rows by position, the cache's rows before the call ----------------------
        pre = _dense(mixed, table).float()
        # a sequence starting at position 0 has no history, whatever its slot held before
        fresh = None if cache is None else (first == 0)
        hist = pre.new_zeros(s, kern - 1, pre.shape[-1]) if cache is None else \
            cache.conv[slots].masked_fill(fresh.view(-1, 1, 1), 0.0)
        ext = torch.cat([hist, pre], dim=1)  # [S, K-1+L, C]
        w = self.conv1d.weight.float().squeeze(1)  # [C, K]
        conv = ext[:, 0:length] * w[:, 0]
        for j in range(1, kern):
            conv = conv + ext[:, j:j + length] * w[:, j]
        conv = pointwise(F.silu, conv).to(x.dtype).float()
        if cache is not None:
            idx = (counts[:, None] + torch.arange(kern - 1, device=dev)[None, :])[..., None].expand(-1, -1, ext.shape[-1])
            cache.conv[slots] = ext.gather(1, idx)

        # -- per-token inputs of the delta rule (float32) ------------------------------------------------------
        cq, ck, cv = torch.split(conv, [hk * dk, hk * dk, hv * dv], dim=-1)
        cq, ck, cv = cq.reshape(s, length, hk, dk), ck.reshape(s, length, hk, dk), cv.reshape(s, length, hv, dv)
        if hv != hk:
            cq, ck = cq.repeat_interleave(hv // hk, dim=2), ck.repeat_interleave(hv // hk, dim=2)
        cq = l2norm(cq, divide=self.l2_divide) * (dk ** -0.5)
        ck = l2norm(ck, divide=self.l2_divide)
        g, beta = self.gates(side, table)  # g [S, L, Hv] or [S, L, Hv, Dk], beta [S, L, Hv]
        m = valid[..., None].float()
        beta, g = beta * m, g * (m if g.dim() == 3 else m[..., None])
        cq, ck, cv = cq * m[..., None], ck * m[..., None], cv * m[..., None]

        # -- tiles from the chunk of each sequence's first token ------------------------------------------------
        offset = first % CHUNK  # tokens of the first chunk before the call (in the cache)
        end = offset + counts
        tiles = int(-(-int(end.max()) // CHUNK)) if s else 0
        span = tiles * CHUNK
        col = offset[:, None] + torch.arange(length, device=dev)[None, :]  # each local position's tile column
        col = col.where(valid, span)  # padding goes to a column cut away below

        def placed(x_, head_dim):
            shape = (s, span + 1, hv) + ((head_dim,) if head_dim else ())
            out = x_.new_zeros(shape).index_put((torch.arange(s, device=dev)[:, None].expand_as(col), col), x_)
            out = out[:, :span].view(s, tiles, CHUNK, hv, *((head_dim,) if head_dim else ()))
            return out.transpose(2, 3)  # [S, T, Hv, C, ...]

        per_channel = g.dim() == 4
        tq, tk, tv, tb = placed(cq, dk), placed(ck, dk), placed(cv, dv), placed(beta, 0)
        tg = placed(g, dk if per_channel else 0)
        if cache is not None:  # the partial chunk's earlier tokens
            keep = (torch.arange(CHUNK, device=dev)[None, :] < offset[:, None])[:, None, :]  # [S, 1, C]
            def joined(tile, pending, extra):
                first_tile = torch.where(keep.view(s, 1, CHUNK, *([1] * extra)), pending[slots], tile[:, 0])
                return torch.cat([first_tile.unsqueeze(1), tile[:, 1:]], dim=1)
            tq, tk, tv = joined(tq, cache.q, 1), joined(tk, cache.k, 1), joined(tv, cache.v, 1)
            tg, tb = joined(tg, cache.g, int(per_channel)), joined(tb, cache.beta, 0)
            state = cache.state[slots].masked_fill(fresh.view(-1, 1, 1, 1), 0.0)
        else:
            state = tq.new_zeros(s, hv, dk, dv)
        complete = (torch.arange(1, tiles + 1, device=dev)[None, :] * CHUNK) <= end[:, None]
        out, state = chunk_tiles(tq, tk, tv, tg, tb, state, complete)
        if cache is not None:
            cache.state[slots] = state.detach()
            last = (end // CHUNK).clamp(max=tiles - 1)
            rem = (end % CHUNK)
            keep = (torch.arange(CHUNK, device=dev)[None, :] < rem[:, None])
            ar = torch.arange(s, device=dev)
            for name, tile in (("q", tq), ("k", tk), ("v", tv), ("g", tg), ("beta", tb)):
                part = tile[ar, last]
                mask = keep.view(s, 1, CHUNK, *([1] * (part.dim() - 3)))
                getattr(cache, name)[slots] = torch.where(mask, part, torch.zeros_like(part)).detach()

        # -- each row's output ---------------------------------------------------------------------------------
        flat = out.transpose(2, 3).reshape(s, span, hv, dv)
        return self.output(flat[seq, offset[seq] + local].to(x.dtype), side)  # core [N, Hv, Dv]


class GatedDeltaNet(DeltaRuleMixer):
    hf_name = "linear_attn"

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        dt = cfg.torch_dtype
        self.cfg, self.layer = cfg, layer
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.projections(cfg)
        self.conv1d = _Conv(conv_dim(cfg), cfg.linear_conv_kernel_dim, dt)
        self.dt_bias = nn.Parameter(torch.ones(hv, dtype=dt))
        self.A_log = nn.Parameter(torch.empty(hv, dtype=torch.float32).uniform_(1.0, 16.0).log().to(dt))
        self.norm = GatedNorm(dv, cfg.rms_norm_eps, dt)
        self.out_proj = Linear(hv * dv, cfg.hidden_size, False, dt)

    def projections(self, cfg: DecoderConfig) -> None:
        """The input projections, as Qwen3-Next's files hold them: in_proj_qkvz (per key head interleaved) and in_proj_ba."""
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.in_proj_qkvz = Linear(cfg.hidden_size, 2 * hk * dk + 2 * hv * dv, False, cfg.torch_dtype)
        self.in_proj_ba = Linear(cfg.hidden_size, 2 * hv, False, cfg.torch_dtype)

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor):
        """transformers' per-key-head interleave -> (q [N, Hk*Dk], k, v [N, Hv*Dv], z [N, Hv, Dv], b, a [N, Hv])."""
        cfg, n = self.cfg, qkvz.shape[0]
        hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        r = hv // hk
        q, k, v, z = torch.split(qkvz.view(n, hk, 2 * dk + 2 * r * dv), [dk, dk, r * dv, r * dv], dim=2)
        b, a = torch.split(ba.view(n, hk, 2 * r), [r, r], dim=2)
        return (q.reshape(n, hk * dk), k.reshape(n, hk * dk), v.reshape(n, hv * dv), z.reshape(n, hv, dv),
                b.reshape(n, hv), a.reshape(n, hv))

    def project(self, x):
        q, k, v, z, b, a = self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        return torch.cat([q, k, v], dim=1), (z, b, a)

    def gates(self, side, table):
        _, b, a = side
        bd, ad = _dense(b, table).float(), _dense(a, table).float()
        beta = pointwise(torch.sigmoid, bd)
        g = -pointwise(torch.exp, self.A_log.float()) * pointwise(F.softplus, ad + self.dt_bias.float())
        return g, beta

    def output(self, core, side):
        n, hv, dv = core.shape
        y = self.norm(core.reshape(n * hv, dv), side[0].reshape(n * hv, dv)).view(n, hv * dv)
        return self.out_proj(y)


class SplitGatedDeltaNet(GatedDeltaNet):
    """Gated DeltaNet with Qwen3.5's split projections: in_proj_qkv (all q heads, all k heads, all v heads),
    in_proj_z, in_proj_b, in_proj_a; everything else is GatedDeltaNet's."""

    def projections(self, cfg: DecoderConfig) -> None:
        dt, hidden = cfg.torch_dtype, cfg.hidden_size
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.in_proj_qkv = Linear(hidden, conv_dim(cfg), False, dt)
        self.in_proj_z = Linear(hidden, hv * dv, False, dt)
        self.in_proj_b = Linear(hidden, hv, False, dt)
        self.in_proj_a = Linear(hidden, hv, False, dt)

    def project(self, x):
        n, hv, dv = x.shape[0], self.cfg.linear_num_value_heads, self.cfg.linear_value_head_dim
        return self.in_proj_qkv(x), (self.in_proj_z(x).view(n, hv, dv), self.in_proj_b(x), self.in_proj_a(x))


class KimiDeltaAttention(DeltaRuleMixer):
    """Kimi Delta Attention (transformers' KimiLinearDeltaAttention; parameter names as Kimi Linear's files):
    q_proj / k_proj / v_proj into the one causal conv (`conv1d`, the files' q_conv1d, k_conv1d, v_conv1d stacked)
    + SiLU; a per-key-channel forget gate g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias) (float32);
    beta = sigmoid(b_proj(x)); q and k l2-normalised as x / sqrt(sum x^2 + eps); the gated delta rule with the
    per-channel decay (ops/delta_rule.py, the same arithmetic as Gated DeltaNet's); the output norm (`o_norm`:
    rms-normalised in float32 times its weight, times sigmoid(g_b_proj(g_a_proj(x)))) and o_proj. H heads of
    size D for queries, keys and values alike (linear_num_*_heads, linear_*_head_dim).
    Deviation from transformers: beta's sigmoid in float32 (transformers: the model dtype), as Gated DeltaNet's."""

    l2_divide = True

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        dt = cfg.torch_dtype
        self.cfg, self.layer = cfg, layer
        h, d, hidden = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.hidden_size
        self.q_proj = Linear(hidden, h * d, False, dt)
        self.k_proj = Linear(hidden, h * d, False, dt)
        self.v_proj = Linear(hidden, h * d, False, dt)
        self.conv1d = _Conv(conv_dim(cfg), cfg.linear_conv_kernel_dim, dt)
        self.f_a_proj = Linear(hidden, d, False, dt)
        self.f_b_proj = Linear(d, h * d, False, dt)
        self.dt_bias = nn.Parameter(torch.zeros(h * d, dtype=dt))
        self.A_log = nn.Parameter(torch.empty(1, 1, h, 1, dtype=torch.float32).uniform_(1.0, 16.0).log().to(dt))
        self.b_proj = Linear(hidden, h, False, dt)
        self.g_a_proj = Linear(hidden, d, False, dt)
        self.g_b_proj = Linear(d, h * d, False, dt)
        self.o_norm = GatedNorm(d, cfg.rms_norm_eps, dt, gate=torch.sigmoid, float_weight=True)
        self.o_proj = Linear(h * d, hidden, False, dt)

    def project(self, x):
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=1)
        return mixed, (self.f_b_proj(self.f_a_proj(x)), self.b_proj(x), self.g_b_proj(self.g_a_proj(x)))

    def gates(self, side, table):
        f, b, _ = side
        h, d = self.cfg.linear_num_value_heads, self.cfg.linear_value_head_dim
        fd = _dense(f, table).float() + self.dt_bias.float()
        rate = pointwise(torch.exp, self.A_log.float().view(h, 1))
        g = -rate * pointwise(F.softplus, fd).view(*table.shape, h, d)
        return g, pointwise(torch.sigmoid, _dense(b, table).float())

    def output(self, core, side):
        n, h, d = core.shape
        y = self.o_norm(core.reshape(n * h, d), side[2].reshape(n * h, d)).view(n, h * d)
        return self.o_proj(y)


LINEAR_LAYERS = {"gated_deltanet": GatedDeltaNet, "gated_deltanet_split": SplitGatedDeltaNet,  # by DecoderConfig.linear_kind
                 "kda": KimiDeltaAttention}


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention: q_proj gives each head's query and output gate ([q_h, gate_h] per head), q/k
    norms, RoPE on the first rotary_dim dimensions of each head (partial_rotary_factor), and the attention output
    times sigmoid(gate) before o_proj. The attention itself is the decoder's (layers.attend_rotated)."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        dt, h, d = cfg.torch_dtype, cfg.num_heads, cfg.head_dim
        self.layer, self.cfg = layer, cfg
        self.q_proj = Linear(cfg.hidden_size, 2 * h * d, cfg.attention_bias, dt)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, cfg.attention_bias, dt)
        self.o_proj = Linear(h * d, cfg.hidden_size, cfg.attention_bias, dt)
        self.q_norm = norm(cfg, d)
        self.k_norm = norm(cfg, d)

    def _rope(self, x: torch.Tensor, t) -> torch.Tensor:
        rot = self.cfg.rotary_dim
        theta, scaling = self.cfg.rope(self.layer)
        key = ("partial", rot, theta, scaling)
        if key not in t.ropes:
            t.ropes[key] = ops.rope_cos_sin(t.positions, rot, theta, scaling)
        if rot == x.shape[-1]:
            return ops.rope(x, t.positions, theta, t.ropes[key])
        return torch.cat([ops.rope(x[..., :rot].contiguous(), t.positions, theta, t.ropes[key]), x[..., rot:]], dim=-1)

    def forward(self, x: torch.Tensor, t) -> torch.Tensor:
        cfg, n, h, d = self.cfg, x.shape[0], self.cfg.num_heads, self.cfg.head_dim
        qg = self.q_proj(x).view(n, h, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(n, h * d)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(self.k_proj(x).view(n, cfg.num_kv_heads, d))
        v = self.v_proj(x).view(n, cfg.num_kv_heads, d)
        out = attend_rotated(cfg, self.layer, self._rope(q, t), self._rope(k, t), v, t).reshape(n, h * d)
        return self.o_proj((out.float() * ops.sigmoid(gate)).to(out.dtype))
