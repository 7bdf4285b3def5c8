"""Data parallelism with gradients that do not depend on how many ranks share the batch.

The global batch is cut into `shares` equal slices of rows (a fixed number, e.g. 2, whatever `dp` is); data
rank r computes the logprobs of its shares, each in its own forward. The loss is computed on every rank from the
whole batch's logprobs (gathered in rank order, bits copied), so the loss code is the single-process one. In
the backward each share's parameter gradient is computed alone and the shares' gradients are summed in one
fixed tree over the shares (parallel.tensor.all_gather_sum): dp = 1, 2, ... give the same bits for the same
`shares`. With one share on one rank it is plain autograd.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from nemo_rz.parallel.tensor import all_gather_sum, gather_parts
from nemo_rz.runtime.megatron.model import zero_outside


class _Shares(torch.autograd.Function):
    """Forward: the whole batch's logprobs (every rank's shares, rank order). Backward: each local share's
    parameter gradients alone, summed over all shares of all ranks in the fixed tree, written to .grad."""

    @staticmethod
    def forward(ctx, anchor, owner, local, whole):
        ctx.owner, ctx.local = owner, local
        return whole.clone()

    @staticmethod
    def backward(ctx, grad):
        owner, params = ctx.owner, ctx.owner.params
        rows = ctx.local[0].shape[0]
        first = owner.first_share * rows
        flat = []
        for i, lp in enumerate(ctx.local):
            g = grad[first + i * rows: first + (i + 1) * rows]
            grads = torch.autograd.grad(lp, params, g, allow_unused=True)
            flat.append(torch.cat([(torch.zeros_like(p) if d is None else d).reshape(-1) for p, d in zip(params, grads)]))
        total = all_gather_sum(torch.stack(flat), owner.group)
        offset = 0
        for p in params:
            d = total[offset: offset + p.numel()].view_as(p)
            p.grad = d.clone() if p.grad is None else p.grad + d
            offset += p.numel()
        return None, None, None, None


class DataParallel(nn.Module):
    """`policy` (a MegatronPolicy) over the whole batch, this rank computing its shares (see the module doc)."""

    def __init__(self, policy: nn.Module, shares: int, group):
        super().__init__()
        self.policy, self.group, self.shares = policy, group, shares
        self.dp = dist.get_world_size(group) if group is not None else 1
        if shares % self.dp:
            raise ValueError(f"megatron.grad_shares = {shares} is not a multiple of megatron.dp = {self.dp}; choose a multiple")
        self.per_rank = shares // self.dp
        self.first_share = (dist.get_rank(group) if group is not None else 0) * self.per_rank
        self.anchor = torch.zeros(0, requires_grad=True)  # gives the gathered output a place in the autograd graph
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.config = policy.config

    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, temperature: float = 1.0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.shares == 1:
            return self.policy.token_logprobs(input_ids, lengths, temperature, mask=mask)
        b, length = input_ids.shape
        if lengths is None:
            lengths = torch.full((b,), length, dtype=torch.long)
        pad = (-b) % self.shares  # padding rows of length 1 have no logprob and no gradient
        if pad:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad, length)])
            lengths = torch.cat([lengths, lengths.new_ones(pad)])
        rows = (b + pad) // self.shares
        local = []
        for s in range(self.first_share, self.first_share + self.per_rank):
            cut = slice(s * rows, (s + 1) * rows)
            local.append(self.policy.token_logprobs(input_ids[cut], lengths[cut], temperature))
        mine = torch.cat([lp.detach() for lp in local])
        whole = gather_parts(mine, self.group).reshape(b + pad, length - 1)
        if torch.is_grad_enabled() and any(lp.requires_grad for lp in local):
            whole = _Shares.apply(self.anchor, self, local, whole)
        return zero_outside(whole[:b], mask)

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.policy.load_state_dict(state_dict, strict)

    def parameters(self, recurse: bool = True):
        return self.policy.parameters(recurse)
