"""Data parallelism with gradients that do not depend on how many ranks share the batch, and the pipeline
stages' micro-batches (schedule.py) cut the same way.

The global batch is cut into `shares` equal slices of rows (a fixed number, e.g. 2, whatever `dp` is); data
rank r computes the logprobs of its shares, each in its own forward (under pipeline parallelism: each a
micro-batch of Megatron's schedule). The loss is computed on every rank from the whole batch's logprobs
(gathered in rank order, bits copied; under pipeline parallelism sent from the last stage to every stage), so
the loss code is the single-process one. In the backward each share's parameter gradient is computed alone and
the shares' gradients are summed in one fixed tree over the shares (parallel.tensor.all_gather_sum): dp = 1,
2, ... and pp = 1, 2, ... give the same bits for the same `shares`. With one share on one rank and one stage it
is plain autograd. A tied embedding split across stages gets, per share, the embedding's and the output
layer's gradients summed (two terms: the order does not matter) before the tree.

`taps` (taps.py), while active, hands the forward's features to the auxiliary losses on rank 0.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
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
        rows = ctx.local.rows
        first = owner.first_share * rows
        grads = [grad[first + i * rows: first + (i + 1) * rows] for i in range(owner.per_rank)]
        flat = [torch.cat([(torch.zeros_like(p) if d is None else d).reshape(-1) for p, d in zip(params, share)])
                for share in owner._share_grads(ctx.local, grads)]
        total = all_gather_sum(torch.stack(flat), owner.group)
        offset = 0
        for p in params:
            d = total[offset: offset + p.numel()].view_as(p)
            p.grad = d.clone() if p.grad is None else p.grad + d
            offset += p.numel()
        return None, None, None, None


class _Local:
    """This rank's shares of one forward: their logprobs with their graphs (one stage), or the micro-batches
    the schedule runs again in the backward (pipeline)."""

    def __init__(self, rows: int, lps=None, chunks=None, temperature: float = 1.0):
        self.rows, self.lps, self.chunks, self.temperature = rows, lps, chunks, temperature


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
        self.schedule = None
        if policy.pp_size > 1:
            from nemo_rz.runtime.megatron.schedule import Schedule

            self.schedule = Schedule(policy)
        self.taps = None  # taps.Taps, set by the learner when an auxiliary loss reads the forward
        self.aux_target = None  # taps.TapView on rank 0: what the auxiliary losses hook and read
        self._tied = [p for name, p in policy.gpt.named_parameters() if policy.pp_size > 1 and policy.config.tie_word_embeddings
                      and name in ("embedding.word_embeddings.weight", "output_layer.weight")]

    def _hooks(self, micro_batch):
        return self.taps.hooks(micro_batch) if self.taps is not None else contextlib.nullcontext()

    def _deliver(self, shares: int, rows: int, length: int, lengths: torch.Tensor) -> None:
        if self.taps is None:
            return
        features = self.taps.collect(shares, rows, length, lengths)
        if features is not None and self.aux_target is not None:
            self.aux_target.deliver(self.taps.points, features)

    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, temperature: float = 1.0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        b, length = input_ids.shape
        if lengths is None:
            lengths = torch.full((b,), length, dtype=torch.long)
        if self.shares == 1 and self.schedule is None:
            with self._hooks(lambda: 0):
                lp = self.policy.token_logprobs(input_ids, lengths, temperature, mask=mask)
            self._deliver(1, b, length, lengths)
            return lp
        pad = (-b) % self.shares  # padding rows of length 1 have no logprob and no gradient
        if pad:
            input_ids = torch.cat([input_ids, input_ids.new_zeros(pad, length)])
            lengths = torch.cat([lengths, lengths.new_ones(pad)])
        rows = (b + pad) // self.shares
        cuts = [slice(s * rows, (s + 1) * rows) for s in range(self.first_share, self.first_share + self.per_rank)]
        train = torch.is_grad_enabled() and any(p.requires_grad for p in self.params)
        if self.schedule is None:
            lps = []
            for s, cut in enumerate(cuts, self.first_share):
                with self._hooks(lambda s=s: s):
                    lps.append(self.policy.token_logprobs(input_ids[cut], lengths[cut], temperature))
            mine = torch.cat([lp.detach() for lp in lps])
            local = _Local(rows, lps=lps)
            train = train and any(lp.requires_grad for lp in lps)
        else:
            chunks = [(input_ids[cut], lengths[cut]) for cut in cuts]
            with self._hooks(lambda: self.first_share + self.schedule.micro_batch):
                mine = self.schedule.logprobs(chunks, temperature)
            local = _Local(rows, chunks=chunks, temperature=temperature)
        whole = gather_parts(mine, self.group).reshape(b + pad, length - 1)
        self._deliver(self.shares, rows, length, lengths[:b])
        if train:
            whole = _Shares.apply(self.anchor, self, local, whole)
        return zero_outside(whole[:b], mask)

    def _share_grads(self, local: _Local, grads: list[torch.Tensor]) -> list[list[torch.Tensor | None]]:
        """Each local share's parameter gradients (self.params order) for the logprob gradients `grads`."""
        if local.lps is not None:
            return [torch.autograd.grad(lp, self.params, g, allow_unused=True) for lp, g in zip(local.lps, grads)]
        out = self.schedule.gradients(local.chunks, grads, local.temperature, self.params)
        if self._tied:  # the embedding's gradient (first stage) + the output layer's (last stage), per share
            (p,) = self._tied
            i = next(j for j, q in enumerate(self.params) if q is p)
            group = parallel_state.get_embedding_group()
            for share in out:
                both = gather_parts(share[i] if share[i] is not None else torch.zeros_like(p), group)
                share[i] = both[0] + both[1]
        return out

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return self.policy.state_dict()

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.policy.load_state_dict(state_dict, strict)

    def parameters(self, recurse: bool = True):
        return self.policy.parameters(recurse)
