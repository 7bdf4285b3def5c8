"""Mixture-of-experts arithmetic: router softmax, top-k routing, per-expert linear layers, the weighted combine.

Where a batch changes a token's bits in a MoE layer, and what the consistent forms do about it:
- Router softmax: a row-wise library kernel only where probed row-invariant (verified.py), else fixed row tiles.
- Top-k: a stable descending sort, so ties go to the lower expert index whatever the batch (torch.topk leaves
  ties unspecified). Sorting copies values exactly: nothing to round.
- Per-expert GEMM: how many rows an expert receives depends on the whole batch, and a library GEMM picks its
  blocking from that count. Each expert's rows go through the same row-invariant product as a dense layer
  (a probed library route cut into calls of a fixed row range, or fixed row tiles), in float32.
- Combine: each token's k expert outputs are added in increasing expert index, one element-wise multiply and
  add at a time (each correctly rounded, so no vector/scalar-tail difference), never in slot or value order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import compute_dtype, on_gpu_kernels
from nemo_rz.ops.gemm import padded_route
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.tiles import from_tiles, row_sum, tiled_matmul, to_tiles
from nemo_rz.ops.verified import by_rows, matmul_route, rowwise_route
from nemo_rz.ops.weight_cache import derived


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise softmax of x [N, E] in float32 (the router's probabilities); each row's bits never depend on
    the other rows."""
    if not consistent():
        return torch.softmax(x.float(), dim=-1)
    dt = compute_dtype(x)
    rows = x if x.dtype == dt else x.to(dt)
    route = rowwise_route("softmax", _library_softmax, x.shape[-1], dt, x.device)
    if route is not None:
        return by_rows(_library_softmax, rows, route)
    t = to_tiles(rows)
    with torch.no_grad():  # the shift cancels; no gradient flows through it
        shift = t.amax(dim=-1, keepdim=True)
    e = torch.exp(t - shift)
    return from_tiles(e / row_sum(e), rows.shape[0])


def _library_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Element-wise sigmoid of x [N, E] in float32 (DeepSeek's router scores); each row's bits never depend on
    the other rows (a probed row-wise library route, else fixed row tiles, as `softmax`). Rows narrower than 16
    values (a shared expert's one gate) are zero-padded to 16, so no element lands in a vector loop's scalar tail."""
    if not consistent():
        return torch.sigmoid(x.float())
    dt = compute_dtype(x)
    rows = x if x.dtype == dt else x.to(dt)
    if x.shape[-1] % 16:
        return sigmoid(F.pad(rows, (0, (-x.shape[-1]) % 16)))[:, : x.shape[-1]]
    route = rowwise_route("sigmoid", torch.sigmoid, x.shape[-1], dt, x.device)
    if route is not None:
        return by_rows(torch.sigmoid, rows, route, elementwise=True)
    return from_tiles(torch.sigmoid(to_tiles(rows)), rows.shape[0])


def route_grouped_topk(choice: torch.Tensor, k: int, n_group: int, topk_group: int) -> torch.Tensor:
    """DeepSeek's group-limited selection: the experts [N, k] of each row of choice [N, E] (float32 selection
    scores, E = n_group groups of E / n_group consecutive experts). A group's score is the sum of its two
    largest choices (larger first); the topk_group best groups are kept; the k largest choices among their
    experts win. Consistent: stable descending sorts, so a tie goes to the lower group index, then to the lower
    expert index, whatever the batch; experts are returned by choice descending. Fast: torch.topk (unspecified
    tie order), as the reference implementation."""
    if choice.dim() != 2 or choice.shape[1] % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"route_grouped_topk: choice must be [N, E] with E divisible by n_group={n_group} and "
                         f"1 <= topk_group <= n_group, got {tuple(choice.shape)} and topk_group={topk_group}")
    n, e = choice.shape
    per = e // n_group
    if not 1 <= k <= topk_group * per or per < 2:
        raise ValueError(f"route_grouped_topk: k={k} experts from {topk_group} groups of {per} (need 2 <= group size "
                         "and k <= topk_group * group size)")
    if not bool(torch.isfinite(choice).all()):
        raise ValueError("route_grouped_topk: router scores hold NaN or inf; check the router weights and the hidden states")
    grouped = choice.view(n, n_group, per)
    if not consistent():
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        masked = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
        return torch.topk(masked, k, dim=-1, sorted=False)[1]
    top2 = torch.sort(grouped, dim=-1, descending=True, stable=True)[0]
    group_scores = top2[..., 0] + top2[..., 1]
    groups = torch.sort(group_scores, dim=-1, descending=True, stable=True)[1][:, :topk_group]
    groups = torch.sort(groups, dim=-1)[0]  # the kept groups by index: their experts in increasing index below
    candidates = (groups.unsqueeze(-1) * per + torch.arange(per, device=choice.device)).reshape(n, topk_group * per)
    order = torch.sort(choice.gather(1, candidates), dim=-1, descending=True, stable=True)[1][:, :k]
    return candidates.gather(1, order)


def route_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of scores [N, E] -> (values [N, k] float32, experts [N, k] int64), by value
    descending; among equal values the lower expert index comes first (and wins the last place)."""
    if scores.dim() != 2 or not 1 <= k <= scores.shape[-1]:
        raise ValueError(f"route_topk: scores must be [N, E] with 1 <= k <= E, got {tuple(scores.shape)} and k={k}")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("route_topk: router scores hold NaN or inf; check the router weights and the hidden states")
    if not consistent():
        values, experts = torch.topk(scores, k, dim=-1)
    else:
        values, experts = torch.sort(scores, dim=-1, descending=True, stable=True)
        values, experts = values[:, :k], experts[:, :k]
    return values.float(), experts


def expert_linear(x: torch.Tensor, experts: torch.Tensor, weight_t: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row m of x [M, in] times expert experts[m]'s weight: x[m] @ weight_t[e] (+ bias[e]) -> [M, out] in x's
    dtype. weight_t is [E, in, out] (the layout of fused expert checkpoints), bias [E, out].

    Consistent: float32 accumulation; rows are grouped by expert in a stable order and each group goes through
    a row-invariant product, so a row's bits depend only on the row and its expert's weights (not on how many
    rows that expert got). Backward: library products per expert (deterministic, not batch-invariant).
    Fast: one library product per expert on exactly its rows, in x's dtype."""
    _check_experts(x, experts, weight_t, bias)
    if not consistent():
        return _grouped_fast(x, experts, weight_t, bias)
    return _ExpertLinear.apply(x, experts, weight_t, bias)


def _check_experts(x, experts, weight_t, bias) -> None:
    if x.dim() != 2 or weight_t.dim() != 3 or x.shape[1] != weight_t.shape[1]:
        raise ValueError(f"expert_linear: x must be [M, in] and weight_t [E, in, out], got {tuple(x.shape)} and "
                         f"{tuple(weight_t.shape)}")
    if experts.shape != (x.shape[0],) or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_linear: experts must be an integer [M={x.shape[0]}] tensor, got "
                         f"{experts.dtype} {tuple(experts.shape)}")
    if bias is not None and bias.shape != (weight_t.shape[0], weight_t.shape[2]):
        raise ValueError(f"expert_linear: bias must be [E, out] = {[weight_t.shape[0], weight_t.shape[2]]}, got {tuple(bias.shape)}")
    if experts.numel() and not (0 <= int(experts.min()) and int(experts.max()) < weight_t.shape[0]):
        raise ValueError(f"expert_linear: expert indices must lie in 0..{weight_t.shape[0] - 1}")


def _groups(experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(row order grouping rows by expert, stable; rows per expert)."""
    order = torch.argsort(experts, stable=True)
    return order, torch.bincount(experts, minlength=n_experts).tolist()


def _grouped_fast(x, experts, weight_t, bias):
    order, counts = _groups(experts, weight_t.shape[0])
    xs, parts, start = x.index_select(0, order), [], 0
    for e, c in enumerate(counts):
        if c:
            y = torch.mm(xs[start : start + c], weight_t[e].to(x.dtype))
            parts.append(y if bias is None else y + bias[e].to(x.dtype))
            start += c
    ys = torch.cat(parts) if parts else x.new_empty(0, weight_t.shape[2])
    return ys.index_select(0, torch.argsort(order))


def _float_weights(weight_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight_t as a contiguous `dtype` tensor: itself when it is one, else a copy kept on it until it changes
    (weight_cache, as gemm.weight_t)."""
    if weight_t.dtype == dtype and weight_t.is_contiguous() and weight_t.data_ptr() % 64 == 0:
        return weight_t.detach()  # aligned: so is each expert's slice (see _rows_times)
    return derived(weight_t, "moe.float", lambda: weight_t.detach().to(dtype).contiguous(), dtype)


def _rows_times(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, K] @ w [K, N] (contiguous), each row's bits independent of m and of the other rows."""
    k, n = w.shape
    route = matmul_route(k, n, x.dtype, x.device)
    if route is not None:
        if w.data_ptr() % 64:  # an expert's slice off the allocator's alignment: as the probe, a fresh copy
            w = w.clone()
        return by_rows(lambda rows, out: torch.mm(rows, w, out=out), x, route, width=n)
    padded = padded_route(k, n, x.dtype, x.device)  # as ops.linear: zero columns up to a width with a route
    if padded is not None:
        route, width = padded
        w = F.pad(w, (0, width - n))
        return by_rows(lambda rows, out: torch.mm(rows, w, out=out), x, route, width=width)[:, :n].contiguous()
    return from_tiles(tiled_matmul(to_tiles(x), w), x.shape[0])


def _expert_linear_rows(x, experts, weight_t, bias):
    """The consistent forward on CPU: float32, each expert's rows through a row-invariant product."""
    dt = compute_dtype(x)
    order, counts = _groups(experts, weight_t.shape[0])
    w = _float_weights(weight_t, dt)
    xs = x.index_select(0, order)
    ys = xs.new_empty(x.shape[0], weight_t.shape[2], dtype=dt)
    start = 0
    for e, c in enumerate(counts):
        if c:
            y = _rows_times(xs[start : start + c].to(dt), w[e])
            ys[start : start + c] = y if bias is None else y + bias[e].to(dt)
            start += c
    return ys.index_select(0, torch.argsort(order)).to(x.dtype)


class _ExpertLinear(torch.autograd.Function):
    """Consistent forward (Triton grouped GEMM on CUDA); backward: library products per expert."""

    @staticmethod
    def forward(ctx, x, experts, weight_t, bias):
        ctx.save_for_backward(x, experts, weight_t)
        ctx.bias_dtype = None if bias is None else bias.dtype
        if on_gpu_kernels(x):
            from nemo_rz import kernels

            return kernels.expert_linear(x, experts, _float_weights(weight_t, x.dtype), bias)
        return _expert_linear_rows(x, experts, weight_t, bias)

    @staticmethod
    def backward(ctx, grad):
        x, experts, weight_t = ctx.saved_tensors
        order, counts = _groups(experts, weight_t.shape[0])
        dt = compute_dtype(grad)
        w = _float_weights(weight_t, dt)
        xs, gs = x.index_select(0, order).to(dt), grad.index_select(0, order).to(dt)
        grad_xs = torch.empty_like(xs) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w) if ctx.needs_input_grad[2] else None
        grad_b = gs.new_zeros(w.shape[0], w.shape[2]) if ctx.needs_input_grad[3] else None
        start = 0
        for e, c in enumerate(counts):
            if c:
                g = gs[start : start + c]
                if grad_xs is not None:
                    grad_xs[start : start + c] = torch.mm(g, w[e].t())
                if grad_w is not None:
                    grad_w[e] = torch.mm(xs[start : start + c].t(), g)
                if grad_b is not None:
                    grad_b[e] = g.sum(0)
                start += c
        grad_x = None if grad_xs is None else grad_xs.index_select(0, torch.argsort(order)).to(x.dtype)
        grad_w = None if grad_w is None else grad_w.to(weight_t.dtype)
        return grad_x, None, grad_w, None if grad_b is None else grad_b.to(ctx.bias_dtype)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """sum_j weights[n, j] * y[n * k + j] -> [N, H] in y's dtype, y [N * k, H] holding token n's slot j at row
    n * k + j. Consistent: float32, the slots added in increasing expert index (experts [N, k]), one
    correctly rounded multiply and add per slot. Fast: a library sum over the slots in slot order."""
    n, k = weights.shape
    if y.dim() != 2 or y.shape[0] != n * k or experts.shape != weights.shape:
        raise ValueError(f"moe_combine: y must be [N * k, H] with weights and experts [N, k], got {tuple(y.shape)}, "
                         f"{tuple(weights.shape)} and {tuple(experts.shape)}")
    if not consistent():
        return (y.view(n, k, -1) * weights.to(y.dtype).unsqueeze(-1)).sum(1)
    dt = compute_dtype(y)
    slot = torch.argsort(experts, dim=1, stable=True)  # [N, k]: each token's slots by increasing expert
    w = weights.to(dt).gather(1, slot)
    row = slot + torch.arange(n, device=y.device).unsqueeze(1) * k
    ys = y.to(dt)
    out = w[:, :1] * ys.index_select(0, row[:, 0])
    for j in range(1, k):
        out = out + w[:, j : j + 1] * ys.index_select(0, row[:, j])
    return out if out.dtype == y.dtype else out.to(y.dtype)
