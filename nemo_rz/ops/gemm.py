"""The row-invariant product x @ W.T, forward and backward.

Forward: each output row's bits depend only on that row of x and on W, never on how many rows come with it.
The route is the library GEMM where a probe has shown it row-invariant on this machine (verified.py: calls of
a probed range of row counts, the weight as a contiguous [K, N] matrix: a Linear weight's own storage,
models/layers.py), else fixed row tiles (tiles.py). C++ kernels in MKL's GEMM order (kernels/cpu/matvec.cpp)
take over where a probe (kept on disk like the routes, probe_cache.py) shows them bit-equal to the GEMM route
for the shape: one float32 CPU row (batch-1 decode) goes to the matrix-vector kernel, which streams the weight
once instead of padding the row to the route's min_rows; a bfloat16 weight (float32 accumulation, as every
consistent op) is read as stored by rows_mm for up to ROWS_MM_MAX rows, and widened to float32 for the call
alone above that, so it streams half the bytes and keeps no float32 copy, with the bits the GEMM route gives its
float32 widening. Without the C++ kernels (or where a probe says no) a bfloat16 weight keeps a float32 [K, N]
copy (weight_cache) for the GEMM route, as before. Backward: only the forward's logprobs must equal the
rollout's; gradients need to be deterministic run to run, not batch-invariant, so they are plain library
products (one thread: the same shapes give the same bits).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F

from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.ops.tiles import from_tiles, tiled_matmul, to_tiles
from nemo_rz.ops.verified import Route, by_rows, check_operand, matmul_route, verified
from nemo_rz.ops.weight_cache import derived

MATVEC_PROBE_ROWS = 16  # rows of a probe that compares the matrix-vector kernel with the GEMM route
ROWS_PROBE_COUNTS = (1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 24, 33)  # row counts the rows_mm probe calls
# A bfloat16 weight multiplies up to this many rows as stored (rows_mm: it streams half the bytes, and beats the
# library GEMM on a float32 widening made for the call); more rows take that widening (the GEMM's speed pays it).
ROWS_MM_MAX = 48
PAD_COLUMNS = 8  # a product without a row-invariant route is tried with its columns zero-padded to a multiple of this


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


def own_operand(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """`weight.t()` where it is already the contiguous, aligned [K, N] `dtype` GEMM operand (no copy made), else
    None: what a loaded route's check may multiply instead of a matrix of its own (verified.check_operand)."""
    w_t = weight.detach().t()
    return w_t if w_t.dtype == dtype and w_t.is_contiguous() and w_t.data_ptr() % 64 == 0 else None


def kernel_agrees(kernel: Callable, w_t: torch.Tensor, rows: torch.Tensor, route: Route, counts) -> bool:
    """Does kernel(x, w_t) give every row of x, for x the calls of each row count in `counts` (slices from all
    over `rows`), the bits one routed GEMM call on all of `rows` gives it (w_t widened exactly to float32)?"""
    reference = routed_mm(rows, w_t if w_t.dtype == torch.float32 else w_t.float(), route)
    total = rows.shape[0]
    for m in counts:
        for start in dict.fromkeys((0, (m * 37) % (total - m + 1), total - m)):
            if not torch.equal(kernel(rows[start : start + m].clone(), w_t), reference[start : start + m]):
                return False
    return True


def _check_rows(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 4.0


def matvec_verified(k: int, n: int, route: Route, operand: Callable[[], torch.Tensor | None] | None = None) -> bool:
    """Does the C++ matrix-vector kernel give one float32 CPU row the bits the GEMM route `route` gives it for
    [k, n]? Probed once per machine and build: MATVEC_PROBE_ROWS random rows against their rows of one routed
    GEMM call (False without the C++ kernels). The answer is kept on disk (probe_cache, keyed by the build's tag
    besides the machine key); one read back is checked on a row times the caller's `operand` (or a matrix made
    for the check, verified.check_operand) against a routed call, as a loaded GEMM route is."""
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

    def check(ok) -> bool:
        if ok is False:
            return True  # a stored "no" only costs speed
        w_t = check_operand(operand, k, n, torch.float32, "cpu")
        return ok is True and kernel_agrees(cpu_kernels.matvec, w_t, _check_rows(1, k), route, (1,))

    return bool(verified("matvec", (k, n, route.chunk, route.min_rows, tag), probe, check))


def rows_verified(k: int, n: int, route: Route, dtype: torch.dtype,
                  operand: Callable[[], torch.Tensor | None] | None = None) -> bool:
    """Does the C++ rows_mm kernel, on a contiguous [k, n] weight stored in `dtype` (float32 or bfloat16), give
    every float32 CPU row the bits the GEMM route `route` gives it on the weight's float32 widening, for every row
    count? Probed once per machine and build (row counts 1 to ROWS_PROBE_COUNTS[-1], around the kernel's 8-row
    groups, against one routed call), kept on disk and checked on load as matvec_verified is."""
    tag = cpu_kernels.build_tag()
    if tag is None:
        return False

    def probe() -> bool:
        g = torch.Generator().manual_seed(n * 37 + k)
        w_t = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype)
        rows = torch.randn(ROWS_PROBE_COUNTS[-1] + 7, k, generator=g) * 4.0
        return kernel_agrees(cpu_kernels.rows_mm, w_t, rows, route, ROWS_PROBE_COUNTS)

    def check(ok) -> bool:
        if ok is False:
            return True
        w_t = check_operand(operand, k, n, dtype, "cpu")
        return ok is True and kernel_agrees(cpu_kernels.rows_mm, w_t, _check_rows(9, k), route, (1, 9))

    return bool(verified("rows_mm", (k, n, route.chunk, route.min_rows, tag, dtype), probe, check))


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in x's dtype, row-invariant; no autograd."""
    k, n = x.shape[1], weight.shape[0]
    operand = functools.partial(own_operand, weight, x.dtype)
    route = matmul_route(k, n, x.dtype, x.device, operand)
    if route is not None:
        if x.dtype == torch.float32 and x.is_cpu and weight.dtype == torch.bfloat16:
            stored = functools.partial(own_operand, weight, torch.bfloat16)
            w_s = stored()
            if w_s is not None and rows_verified(k, n, route, torch.bfloat16, stored):
                # read as stored (half the bytes), or widened for this call only: no float32 copy is kept
                return cpu_kernels.rows_mm(x, w_s) if x.shape[0] <= ROWS_MM_MAX else routed_mm(x, w_s.float(), route)
        w_t = weight_t(weight, x.dtype)
        if x.shape[0] == 1 and x.dtype == torch.float32 and x.is_cpu and matvec_verified(k, n, route, operand):
            return cpu_kernels.matvec(x, w_t)
        return routed_mm(x, w_t, route)
    padded = padded_route(k, n, x.dtype, x.device)
    if padded is not None:
        route, width = padded
        w_p = derived(weight, "gemm.tpad", lambda: F.pad(weight.detach().t().to(x.dtype), (0, width - n)).contiguous(), x.dtype)
        return routed_mm(x, w_p, route)[:, :n].contiguous()
    return from_tiles(tiled_matmul(to_tiles(x), weight.to(x.dtype).t()), x.shape[0])


def padded_route(k: int, n: int, dtype: torch.dtype, device) -> tuple[Route, int] | None:
    """(route, width) where the library GEMM is not row-invariant for [k, n] but is for [k, width], width the
    next multiple of PAD_COLUMNS (each output column's reduction depends only on its row and its column, so the
    zero columns added change no bit of the others); None where that is not so either (then fixed row tiles).
    Odd narrow products (a router's n = 6 experts, n = 1) are where GEMMs take M-dependent paths; fixed row tiles
    alone are not enough there on every CPU: AVX2 MKL gives a row other bits at another position in its tile."""
    width = -(-n // PAD_COLUMNS) * PAD_COLUMNS
    if width == n or device.type != "cpu":
        return None
    route = matmul_route(k, width, dtype, device)
    return None if route is None else (route, width)


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
