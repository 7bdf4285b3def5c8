"""Reductions across ranks whose bits do not depend on how many ranks there are.

A collective all-reduce adds the ranks' values in an order its library picks (ring, tree, chunked by size), so
the same numbers summed on 2 or on 4 ranks round differently. Here every rank instead gathers the partial
results in rank order and adds them with `tree_sum`, whose order is fixed by the number of partial results
alone: a computation cut into the same partials gives the same bits on one rank or on many.

The autograd gathers below are the tensor-parallel glue of layers that never add partial results across
ranks (each rank computes whole outputs and the ranks' outputs are concatenated); they run with gloo on CPU
and NCCL on GPU (their buffers live on the input's device).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tree_sum(parts: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Sum of the parts (a list, or the first dim of a tensor) in a fixed pairwise tree:
    ((p0 + p1) + (p2 + p3)) + ..., an odd part carried up a level unchanged."""
    level = list(parts)
    if not level:
        raise ValueError("tree_sum: nothing to sum")
    while len(level) > 1:
        paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0]


def gather_parts(x: torch.Tensor, group=None) -> torch.Tensor:
    """[world, *x.shape]: every rank's x in rank order (x has the same shape on every rank)."""
    world = dist.get_world_size(group)
    if world == 1:
        return x.unsqueeze(0)
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
    return out


def all_gather_sum(parts: torch.Tensor, group=None) -> torch.Tensor:
    """Sum over all ranks of their partial results `parts` [n, ...] (n per rank, the same on every rank), in the
    tree of the whole sequence of world * n parts in rank order: the bits depend on that sequence only."""
    gathered = gather_parts(parts, group)
    return tree_sum(gathered.reshape(-1, *parts.shape[1:]))


def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    size = x.shape[-1] // world
    return x[..., rank * size:(rank + 1) * size].contiguous()


def _cat_last(x: torch.Tensor, group) -> torch.Tensor:
    parts = gather_parts(x, group)
    return torch.cat(parts.unbind(0), dim=-1)


class _GatherLast(torch.autograd.Function):
    """Concatenate every rank's x along the last dim; backward keeps this rank's slice of the gradient, after
    summing the ranks' gradients when each rank's is partial (sum_grad)."""

    @staticmethod
    def forward(ctx, x, group, sum_grad: bool):
        ctx.group, ctx.sum_grad = group, sum_grad
        return _cat_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.sum_grad:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
        return _own_slice(grad, ctx.group), None, None


def gather_last(x: torch.Tensor, group=None, grad: str = "slice") -> torch.Tensor:
    """Every rank's x concatenated along the last dim, in rank order (bits copied, nothing added).
    grad="slice": the output's gradient is the same on every rank (replicated computation follows);
    grad="sum": each rank's gradient is partial (each rank used the gathered x for its own outputs)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    if grad not in ("slice", "sum"):
        raise ValueError(f"gather_last: grad={grad!r}; use slice or sum")
    return _GatherLast.apply(x, group, grad == "sum")
