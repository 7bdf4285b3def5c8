"""The gated delta rule (Gated DeltaNet, Qwen3-Next / Qwen3.5) in chunk-synchronised tiles: one arithmetic for
the learner's forward, prefill, decode and chunked prefill.

The recurrence, per value head, with a float32 state S [Dk, Dv]:

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T        o_t = S_t^T q_t

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


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (float32), the sum in a fixed order (left to right)."""
    sq = x * x
    total = sq[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + sq[..., j]
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


def chunk_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, complete: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of S sequences, float32: q, k [S, T, H, C, Dk] (q already l2-normalised and scaled, k
    l2-normalised), v [S, T, H, C, Dv], g (log decay, <= 0) and beta [S, T, H, C]; tile i of a sequence is its
    chunk number i from its first, zeros after its last token. state [S, H, Dk, Dv]: the committed state at the
    first tile's start. complete [S, T] (bool): whether tile i is a whole chunk (its state is committed).
    Returns (outputs [S, T, H, C, Dv], the state after the last complete tile [S, H, Dk, Dv])."""
    incl, strict = _masks(q.device)
    gc = g.cumsum(-1)  # [S, T, H, C]: a fixed sequential order along the chunk
    gamma = pointwise(torch.exp, (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~incl, float("-inf")))
    kt = k.transpose(-1, -2)
    kb = k * beta.unsqueeze(-1)
    system = bmm(kb, kt) * gamma  # the strictly lower part is the UT system's (the diagonal is not read)
    system = system.masked_fill(~strict, 0.0)
    egc = pointwise(torch.exp, gc).unsqueeze(-1)
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * egc, upper=False, unitriangular=True)
    attn = bmm(q, kt) * gamma
    qd = q * egc
    last = gc[..., -1:]
    kd = k * pointwise(torch.exp, last - gc).unsqueeze(-1)
    chunk_decay = pointwise(torch.exp, last).unsqueeze(-1)  # [S, T, H, 1, 1]
    outs = []
    for i in range(q.shape[1]):
        v_new = u[:, i] - bmm(w[:, i], state)
        outs.append(bmm(qd[:, i], state) + bmm(attn[:, i], v_new))
        if i + 1 < q.shape[1] or bool(complete[:, i].any()):
            new = state * chunk_decay[:, i] + bmm(kd[:, i].transpose(-1, -2), v_new)
            state = torch.where(complete[:, i].view(-1, 1, 1, 1), new, state)
    return torch.stack(outs, 1), state
