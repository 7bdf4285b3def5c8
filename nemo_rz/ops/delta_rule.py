"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5; Kimi Delta Attention, Kimi Linear) in
chunk-synchronised tiles: one arithmetic for the learner's forward, prefill, decode and chunked prefill.

The recurrence, per value head, with a float32 state S [Dk, Dv] and a decay D_t = diag(exp(g_t)):

    S_t = D_t S_{t-1} + k_t beta_t (v_t - (D_t S_{t-1})^T k_t)^T        o_t = S_t^T q_t

Gated DeltaNet's gate g_t is one number per head (D_t a multiple of the identity); Kimi Delta Attention's is one
per key channel (g_t [Dk]). The same code runs both: the gate's shape picks how the decayed pair products
q_i . k_j exp(G_i - G_j) are formed (a scalar factor on a product of the whole tile, or the channels' decays
inside the product), and everything else (the UT solve, the state commits, the inter-chunk part) broadcasts the
gate over a trailing axis of size 1 or Dk.

Scheme. Positions are cut into chunks of CHUNK tokens at absolute multiples of CHUNK (0, 64, 128, ...), never at
the start of a call. The state is committed only at chunk boundaries, by the chunked (WY / UT-transform) form of
a whole chunk. A token's output is computed from the committed state at its chunk's start plus the intra-chunk
part over the tokens of its chunk up to itself, always in one fixed tile: the chunk padded to CHUNK rows (zeros
after the last token present), causal. A decode step therefore recomputes its partial chunk in exactly the tile
shape prefill used; the rows after a token get exact zero weight (causal masks, lower-triangular solves), so
its row has the same bits whether the rest of the chunk is known (prefill) or padding (decode). The cache of a
sequence holds S at its last boundary and the current partial chunk's inputs (< CHUNK tokens, float32): see
models/linear_attention.py.

Every product is a fixed-shape batched matmul (`bmm`: 16 matrices per call) or triangular solve of [CHUNK, *]
tiles (each tile's bits do not depend on how many tiles a call runs), and every transcendental element-wise op runs through `pointwise`
(single-threaded, padded to whole SIMD steps, so no element lands in a vector loop's scalar tail). The same code
runs under autograd for the learner (a loop over chunks, not tokens).

`fast` mode changes nothing here: the standard forms this scheme is compared against are transformers' chunked
prefill (chunks anchored at each call's start) and token-by-token recurrent decode (tests use them as the
negative control).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nemo_rz.ops.tiles import from_tiles, row_sum, to_tiles
from nemo_rz.ops.verified import one_thread

CHUNK = 64
_STEP = 64  # element-wise ops see a multiple of this many elements


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (element-wise: exp, softplus, sigmoid, silu) of x with bits that do not depend on x's size: flattened,
    zero-padded to a multiple of 64 elements, on one thread (no scalar tail, no split across threads)."""
    flat = x.reshape(-1)
    n = flat.shape[0]
    pad = (-n) % _STEP
    with one_thread():
        y = fn(F.pad(flat, (0, pad)) if pad else flat.contiguous())
    return (y[:n] if pad else y).view(x.shape)


def l2norm(x: torch.Tensor, eps: float = 1e-6, divide: bool = False) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (float32), the sum in a fixed order (left to right): as x times
    rsqrt (Gated DeltaNet, transformers' Qwen3-Next) or, with `divide`, x divided by sqrt (Kimi Delta Attention,
    as FLA's kernel and transformers' Kimi Linear)."""
    sq = x * x
    total = sq[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + sq[..., j]
    if divide:
        return x / pointwise(torch.sqrt, total + eps).unsqueeze(-1)
    return x * pointwise(torch.rsqrt, total + eps).unsqueeze(-1)


_GROUP = 16  # matrices per torch.bmm call


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., m, k] @ b [..., k, n] (b broadcast over a's leading dims) in calls of exactly 16 contiguous matrix
    pairs (zero-padded): a library batched GEMM may pick another kernel or thread split for another batch count,
    a fixed count gives each matrix the same bits in any call. Differentiable."""
    lead = a.shape[:-2]
    a2 = a.reshape(-1, *a.shape[-2:]).contiguous()
    b2 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:]).contiguous()
    n = a2.shape[0]
    pad = (-n) % _GROUP
    if pad:
        a2, b2 = F.pad(a2, (0, 0, 0, 0, 0, pad)), F.pad(b2, (0, 0, 0, 0, 0, pad))
    out = torch.cat([torch.bmm(a2[i:i + _GROUP], b2[i:i + _GROUP]) for i in range(0, a2.shape[0], _GROUP)])
    return out[:n].view(*lead, a.shape[-2], b.shape[-1])


def _masks(device) -> tuple[torch.Tensor, torch.Tensor]:
    ones = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device)
    return ones.tril(), ones.tril(-1)


def _decayed(q: torch.Tensor, kb: torch.Tensor, k: torch.Tensor, gc: torch.Tensor,
             incl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_i . k_j exp(G_i - G_j), kb_i . k_j exp(G_i - G_j)) of each tile, [.., C, C], exact zeros for j > i. gc:
    the cumulative gates [.., C, 1] (one per head: the products of the whole tile times one decay matrix) or
    [.., C, Dk] (one per key channel: each pair's channels decayed inside the product, as one fixed-shape
    element-wise products summed over Dk by ops/tiles.row_sum, fixed [32, Dk] row tiles times a column of ones, in
    an order fixed by Dk alone: exp(G_i - G_j) never splits into factors that overflow)."""
    if gc.shape[-1] == 1:
        g1 = gc.squeeze(-1)
        gamma = pointwise(torch.exp, (g1.unsqueeze(-1) - g1.unsqueeze(-2)).masked_fill(~incl, float("-inf")))
        kt = k.transpose(-1, -2)
        return bmm(q, kt) * gamma, bmm(kb, kt) * gamma
    decay = pointwise(torch.exp, (gc.unsqueeze(-2) - gc.unsqueeze(-3)).masked_fill(~incl.unsqueeze(-1), float("-inf")))
    kd = k.unsqueeze(-3) * decay  # [.., i, j, Dk]: k_j decayed from j to i, zero past i

    def summed(a: torch.Tensor) -> torch.Tensor:  # sum_d a_i,d kd_i,j,d: fixed row tiles times a column of ones
        rows = (kd * a.unsqueeze(-2)).reshape(-1, kd.shape[-1])
        return from_tiles(row_sum(to_tiles(rows)), rows.shape[0]).view(kd.shape[:-1])

    return summed(q), summed(kb)


def chunk_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, complete: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of S sequences, float32: q, k [S, T, H, C, Dk] (q already l2-normalised and scaled, k
    l2-normalised), v [S, T, H, C, Dv], g (log decay, <= 0) [S, T, H, C] (one per head) or [S, T, H, C, Dk] (one
    per key channel), beta [S, T, H, C]; tile i of a sequence is its chunk number i from its first, zeros after
    its last token. state [S, H, Dk, Dv]: the committed state at the first tile's start. complete [S, T] (bool):
    whether tile i is a whole chunk (its state is committed).
    Returns (outputs [S, T, H, C, Dv], the state after the last complete tile [S, H, Dk, Dv])."""
    incl, strict = _masks(q.device)
    gc = (g if g.dim() == q.dim() else g.unsqueeze(-1)).cumsum(-2)  # [S, T, H, C, 1 | Dk]: a fixed order along the chunk
    kb = k * beta.unsqueeze(-1)
    attn, system = _decayed(q, kb, k, gc, incl)
    system = system.masked_fill(~strict, 0.0)  # the UT system's strictly lower part (the diagonal is not read)
    egc = pointwise(torch.exp, gc)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * egc, upper=False, unitriangular=True)
    qd = q * egc
    last = gc[..., -1:, :]
    kd = k * pointwise(torch.exp, last - gc)
    chunk_decay = pointwise(torch.exp, last).transpose(-1, -2)  # [S, T, H, 1 | Dk, 1]: the state's rows' decay
    outs = []
    for i in range(q.shape[1]):
        v_new = u[:, i] - bmm(w[:, i], state)
        outs.append(bmm(qd[:, i], state) + bmm(attn[:, i], v_new))
        if i + 1 < q.shape[1] or bool(complete[:, i].any()):
            new = state * chunk_decay[:, i] + bmm(kd[:, i].transpose(-1, -2), v_new)
            state = torch.where(complete[:, i].view(-1, 1, 1, 1), new, state)
    return torch.stack(outs, 1), state
