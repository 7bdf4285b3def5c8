"""The row-invariant product x @ W.T, forward and backward.

Forward: each output row's bits depend only on that row of x and on W, never on how many rows come with it.
The route is the library GEMM where a probe has shown it row-invariant on this machine (verified.py: calls of
a probed range of row counts, the weight as a contiguous [K, N] copy made once per weight version), else
fixed row tiles (tiles.py). Backward: only the forward's logprobs must equal the rollout's; gradients need to
be deterministic run to run, not batch-invariant, so they are plain library products (one thread: the same
shapes give the same bits).
"""
from __future__ import annotations

import torch

from nemo_rz.ops.tiles import from_tiles, tiled_matmul, to_tiles
from nemo_rz.ops.verified import by_rows, matmul_route
from nemo_rz.ops.weight_cache import derived


def weight_t(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] as a contiguous [K, N] `dtype` matrix, kept on the weight until it changes (weight_cache:
    in-place updates are seen; whoever writes through `.data` calls `forget_weight_copies` afterwards). Costs
    one copy of each weight."""
    return derived(weight, "gemm.t", lambda: weight.detach().t().to(dtype).contiguous(), dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype, row-invariant; no autograd."""
    k, n = x.shape[1], weight.shape[0]
    route = matmul_route(k, n, x.dtype, x.device)
    if route is not None:
        w_t = weight_t(weight, x.dtype)
        return by_rows(lambda rows, out: torch.mm(rows, w_t, out=out), x, route, width=n)
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
