"""The row-invariant product x @ W.T, forward and backward.

Forward: each output row's bits depend only on that row of x and on W, never on how many rows come with it.
The route is the library GEMM where a probe has shown it row-invariant on this machine (verified.py: calls of
a probed range of row counts, the weight as a contiguous [K, N] copy made once per weight version), else
fixed row tiles (tiles.py). One float32 CPU row (batch-1 decode) goes, where a probe admits it for the shape,
to a C++ matrix-vector kernel in MKL's GEMM order (kernels/cpu/matvec.cpp): it streams the weight once instead
of padding the row to the route's min_rows, and gives the row the bits the GEMM route gives it. Backward: only
the forward's logprobs must equal the rollout's; gradients need to be deterministic run to run, not
batch-invariant, so they are plain library products (one thread: the same shapes give the same bits).
"""
from __future__ import annotations

import torch

from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.ops.tiles import from_tiles, tiled_matmul, to_tiles
from nemo_rz.ops.verified import Route, by_rows, matmul_route, verified
from nemo_rz.ops.weight_cache import derived

MATVEC_PROBE_ROWS = 16  # rows of a probe that compares the matrix-vector kernel with the GEMM route


def weight_t(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] as a contiguous, 64-byte aligned [K, N] `dtype` matrix: `weight.t()` itself when the weight
    is laid out so (models/layers.py Linear) and in `dtype`, else a copy kept on the weight until it changes
    (weight_cache: in-place updates are seen; whoever writes through `.data` calls `forget_weight_copies`)."""
    w_t = weight.detach().t()
    if w_t.dtype == dtype and w_t.is_contiguous() and w_t.data_ptr() % 64 == 0:
        return w_t
    return derived(weight, "gemm.t", lambda: w_t.to(dtype).contiguous(), dtype)


def routed_mm(x: torch.Tensor, w_t: torch.Tensor, route: Route) -> torch.Tensor:
    """x [M, K] @ w_t [K, N] through the library GEMM in calls of the route's row counts (rows below its
    min_rows are zero-padded)."""
    return by_rows(lambda rows, out: torch.mm(rows, w_t, out=out), x, route, width=w_t.shape[1])


def matvec_verified(k: int, n: int, route: Route) -> bool:
    """Does the C++ matrix-vector kernel give one float32 CPU row the bits the GEMM route `route` gives it for
    [k, n]? Probed once per process and build: every one of MATVEC_PROBE_ROWS random rows against their rows of
    one routed GEMM call (False without the C++ kernels)."""
    tag = cpu_kernels.build_tag()
    if tag is None:
        return False

    def probe() -> bool:
        g = torch.Generator().manual_seed(n * 31 + k)
        w_t = torch.randn(k, n, generator=g) / k ** 0.5
        rows = torch.randn(MATVEC_PROBE_ROWS, k, generator=g) * 4.0
        reference = routed_mm(rows, w_t, route)
        return all(torch.equal(cpu_kernels.matvec(rows[i : i + 1].clone(), w_t), reference[i : i + 1])
                   for i in range(rows.shape[0]))

    return bool(verified("matvec", (k, n, route.chunk, route.min_rows, tag), probe))


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype, row-invariant; no autograd."""
    k, n = x.shape[1], weight.shape[0]
    route = matmul_route(k, n, x.dtype, x.device)
    if route is not None:
        w_t = weight_t(weight, x.dtype)
        if x.shape[0] == 1 and x.dtype == torch.float32 and x.is_cpu and matvec_verified(k, n, route):
            return cpu_kernels.matvec(x, w_t)
        return routed_mm(x, w_t, route)
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
