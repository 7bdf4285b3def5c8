"""The row-invariant product x @ W.T, forward and backward.

Forward: each output row's bits depend only on that row of x and on W, never on how many rows come with it.
The route is the library GEMM where a probe has shown it row-invariant on this machine (verified.py: calls of
MIN_ROWS up to a chunk of rows, the weight as a contiguous [K, N] copy made once per weight version), else
fixed row tiles (tiles.py). Backward: only the forward's logprobs must equal the rollout's; gradients need to
be deterministic run to run, not batch-invariant, so they are plain library products (one thread: the same
shapes give the same bits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.tiles import from_tiles, tiled_matmul, to_tiles
from nemo_rz.ops.verified import MIN_ROWS, matmul_chunk_rows

_ALIGN = 64  # bytes: the CPU allocator's alignment; a view off it is copied, so BLAS sees what the probe saw


def _aligned(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        return x.contiguous()
    return x if x.data_ptr() % _ALIGN == 0 else x.clone()


def weight_t(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] as a contiguous [K, N] `dtype` matrix, kept on the weight until it changes (its version
    counter moves on every in-place update, an optimizer step included). Costs one copy of the weight."""
    if weight.is_inference():  # no version counter to tell an update: never cached
        return weight.t().to(dtype).contiguous()
    key = (weight._version, weight.data_ptr(), dtype)
    cached = getattr(weight, "_nemo_rz_t", None)
    if cached is None or cached[0] != key:
        cached = (key, weight.detach().t().to(dtype).contiguous())
        weight._nemo_rz_t = cached
    return cached[1]


def _mm_chunks(x: torch.Tensor, w_t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[M, K] @ [K, N] in calls of MIN_ROWS..chunk rows (the probed range)."""
    m = x.shape[0]
    if m < MIN_ROWS:
        return torch.mm(F.pad(x, (0, 0, 0, MIN_ROWS - m)), w_t)[:m]
    if m <= chunk:
        return torch.mm(_aligned(x), w_t)
    out = x.new_empty(m, w_t.shape[1])
    for start in range(0, m, chunk):
        stop = min(start + chunk, m)
        if stop - start < MIN_ROWS:  # a short last chunk: computed inside a MIN_ROWS-row call ending at it
            out[start:stop] = torch.mm(_aligned(x[stop - MIN_ROWS : stop]), w_t)[MIN_ROWS - (stop - start):]
        else:
            torch.mm(_aligned(x[start:stop]), w_t, out=out[start:stop])
    return out


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype, row-invariant; no autograd."""
    k, n = x.shape[1], weight.shape[0]
    chunk = matmul_chunk_rows(k, n, x.dtype, x.device)
    if chunk:
        return _mm_chunks(x, weight_t(weight, x.dtype), chunk)
    return from_tiles(tiled_matmul(to_tiles(x), weight.to(x.dtype).t()), x.shape[0])


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return matmul(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = torch.mm(grad, weight.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_w = torch.mm(grad.t(), x).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """matmul with autograd: row-invariant forward, deterministic library backward."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Matmul.apply(x, weight)
    return matmul(x, weight)
