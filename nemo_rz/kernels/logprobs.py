"""Batch-invariant log-softmax and token log-probabilities over the vocabulary, in fp32.

Invariance rule: one program per row. Each logit is divided by the temperature (IEEE fp32 division, as
``logits.float() / T`` in torch), then the row is scanned in fixed-size blocks of V (BLOCK_V depends
only on V) in increasing order with an online max/sum: per block ``m' = max(m, max(block))``,
``s = s * exp(m - m') + sum(exp(block - m'))``. The log-probability of column j is
``(x_j - m) - log(s)``. ``token_logprobs`` and ``log_softmax`` run the same per-row code, so
``token_logprobs(l, t, T)[i] == log_softmax(l, T)[i, t[i]]`` bit for bit, and no value depends on M,
on the other rows or on the row's position in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INDEX_DTYPES, check_device, check_tensor, next_pow2

MAX_BLOCK_V = 4096


def block_v(V: int) -> int:
    """Block over the vocabulary: a function of V only."""
    return min(MAX_BLOCK_V, next_pow2(V))


@triton.jit
def _row_stats(row_ptr, V, temperature, BLOCK_V: tl.constexpr):
    """Online max and rescaled exp-sum of one row of logits / temperature, blocks in increasing order."""
    offs = tl.arange(0, BLOCK_V)
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        x = tl.load(row_ptr + v0 + offs, mask=mask, other=-float("inf")).to(tl.float32)
        x = tl.div_rn(x, temperature)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # m_new is -inf only if every logit so far is -inf; keep exp() away from (-inf) - (-inf)
        m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref), axis=0)
        m = m_new
    return m, s


@triton.jit
def _token_logprobs_kernel(logits_ptr, targets_ptr, out_ptr, V, stride_l, temperature, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    m, s = _row_stats(row_ptr, V, temperature, BLOCK_V)
    t = tl.load(targets_ptr + row).to(tl.int64)
    ok = (t >= 0) & (t < V)
    xt = tl.load(row_ptr + tl.where(ok, t, 0)).to(tl.float32)
    xt = tl.div_rn(xt, temperature)
    lp = (xt - m) - tl.log(s)
    tl.store(out_ptr + row, tl.where(ok, lp, float("nan")))


@triton.jit
def _log_softmax_kernel(logits_ptr, out_ptr, V, stride_l, temperature, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_l
    m, s = _row_stats(row_ptr, V, temperature, BLOCK_V)
    log_s = tl.log(s)
    offs = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        mask = v0 + offs < V
        x = tl.load(row_ptr + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.div_rn(x, temperature)
        tl.store(out_ptr + row * V + v0 + offs, (x - m) - log_s, mask=mask)


def _check_logits(name, logits, temperature):
    check_tensor(name, "logits", logits, 2, rows_strided=True)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{name}: temperature must be a float > 0, got {temperature!r}")
    if temperature == float("inf"):
        raise ValueError(f"{name}: temperature must be finite")


def _launch_rows(kernel, M, *args, bv):
    kernel[(M,)](*args, BLOCK_V=bv, num_warps=4 if bv <= 1024 else 8)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   *, _block_v: int | None = None) -> torch.Tensor:
    """``log_softmax(logits [M, V] / temperature)[i, targets[i]]`` -> float32 ``[M]``.

    ``targets`` is int64 (int32 accepted) ``[M]``; a target outside ``[0, V)`` gives NaN (values are not
    checked on the host, to avoid a device sync). ``_block_v`` is for tests only.
    """
    _check_logits("token_logprobs", logits, temperature)
    check_tensor("token_logprobs", "targets", targets, 1, INDEX_DTYPES)
    if targets.shape[0] != logits.shape[0]:
        raise ValueError(f"token_logprobs: targets is [{targets.shape[0]}] but logits is [M={logits.shape[0]}, V]")
    check_device("token_logprobs", [logits, targets])
    M, V = logits.shape
    out = torch.empty((M,), dtype=torch.float32, device=logits.device)
    if M == 0:
        return out
    if V == 0:
        raise ValueError("token_logprobs: logits has an empty vocabulary (V == 0)")
    _launch_rows(_token_logprobs_kernel, M, logits, targets, out, V, logits.stride(0), float(temperature),
                 bv=_block_v or block_v(V))
    return out


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, *, _block_v: int | None = None) -> torch.Tensor:
    """``log_softmax(logits [M, V] / temperature, dim=-1)`` -> float32 ``[M, V]`` (same row code as
    ``token_logprobs``). ``_block_v`` is for tests only."""
    _check_logits("log_softmax", logits, temperature)
    check_device("log_softmax", [logits])
    M, V = logits.shape
    out = torch.empty((M, V), dtype=torch.float32, device=logits.device)
    if M == 0 or V == 0:
        return out
    _launch_rows(_log_softmax_kernel, M, logits, out, V, logits.stride(0), float(temperature), bv=_block_v or block_v(V))
    return out
