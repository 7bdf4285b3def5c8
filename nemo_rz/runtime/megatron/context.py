"""Context parallelism for the Megatron learner (`megatron.cp`): a batch's sequences packed into one row, the row
split over the context-parallel ranks by parallel.context's zigzag shard, every layer's core attention the ring.

Layout. A learner batch [B, T] with its lengths becomes one packed row of sum(lengths) tokens, no padding
(models.decoder.packed_rows, the layout of Decoder.packed), cut by `ZigzagShard` over the context-parallel group.
Each rank runs Megatron's GPTModel on its own tokens as one [1, n] sequence; the layers read the forward's tokens
from `packed_seq_params` (layers.TokenParams): a decoder.Tokens with the shard's positions (RoPE), sequence ids,
and `attend` = parallel.context.ring_attention over the shard, so layers.CoreAttention's `models.layers.attend`
applies the layer's RoPE and hands q, k, v to the ring. The rest is parallel.context.cp_token_logprobs, the same
function the built-in Decoder runs under context parallelism (this module's `ContextParallel` is its model: the
GPTModel's forward of the tokens, then the whole vocabulary gathered over the tensor-parallel ranks, ops'
log-softmax at the next token). The ranks' logprobs are gathered in row order (bits copied) and laid out as the
batch's [B, T-1], so the loss runs on every rank from the whole batch, as at cp = 1.

Bits. The ring computes every query's attention with ops.attention's consistent core, adding partials in
key-block order whatever rank computed them; every other op is row-wise. So the logprobs equal cp = 1's and the
built-in Decoder's bit for bit, at any cp (and tp: heads and vocabulary are split as at cp = 1).

Gradients. A rank's backward reaches its own tokens only, so each rank holds its tokens' part of every parameter
gradient. `_Reduced` (the autograd node of the gathered logprobs) computes that part and adds the ranks' parts in
a fixed tree over the context-parallel group (parallel.context.tree_reduce), rather than Megatron's gradient
all-reduce over the group, whose order is the library's: every rank gets the same bits, in every run, and the
optimizers of the ranks stay in step. They equal cp = 1's gradients within float32 rounding, not bit for bit: at
cp = 1 a weight's gradient is one product over all tokens, here the sum of the ranks' products over theirs
(measured in tests/test_megatron_context.py: within 2e-6 of each parameter's largest entry). With data
parallelism each share's gradient is reduced this way, then the shares' in data_parallel's tree.

A co-trained draft (draft.mode=cotrain, the auxiliary-loss taps of taps.py): every context-parallel rank of
tensor-parallel rank 0 keeps its own tokens' outputs of the tapped layers (`local_rows`: the rows cp = 1 computes
for those tokens, in the shard's order) and trains its copy of the draft on them: the draft's training-time test
runs over the same zigzag shard, through the ring and rank-local branch attention (parallel.context.cp_draft_loss,
called by algorithms.draft.DraftTrainer.context_step); the ranks' draft gradients are added in a fixed tree over
the group and every copy takes the same optimizer step. The draft's loss and metrics are one process's bits, its
gradients (and so its weights after a step) equal one process's within float32 rounding
(tests/test_megatron_context.py).

Refused, in one line: the fast kernels (Megatron's local DotProductAttention has no context parallelism without
Transformer Engine: it would attend within each rank's tokens only), models the ring does not compute (sliding
windows, sinks, mixtures of experts: parallel.context.check_model), and context with pipeline parallelism.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

from nemo_rz.models.decoder import Tokens, packed_rows, prepared
from nemo_rz.parallel.context import ZigzagShard, check_model, cp_token_logprobs, tree_reduce
from nemo_rz.parallel.tensor import gather_last
from nemo_rz.runtime.megatron import layers


def group():
    """Megatron's context-parallel group of this process."""
    return parallel_state.get_context_parallel_group()


def for_policy(policy) -> ContextParallel | None:
    """The token layout of a MegatronPolicy: None at megatron.cp = 1 (the dense [B, T] batch), else the packed row
    over the context-parallel ranks."""
    if not parallel_state.model_parallel_is_initialized() or parallel_state.get_context_parallel_world_size() == 1:
        return None
    return ContextParallel(policy, group())


class ContextParallel:
    """A MegatronPolicy's forward over the context-parallel ranks (see the module docstring)."""

    def __init__(self, policy, cp_group):
        cp = dist.get_world_size(cp_group)
        if policy.fast:
            raise ValueError(f"megatron.cp = {cp} with kernels=fast: Megatron's local attention (DotProductAttention) "
                             "has no context parallelism without Transformer Engine; use kernels=consistent or "
                             "megatron.cp=1")
        check_model(policy.config)
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if pp > 1:
            raise ValueError(f"megatron.cp = {cp} with megatron.pp = {pp}: context parallelism does not run inside "
                             "the pipeline schedule yet; use megatron.cp=1 or megatron.pp=1")
        self.policy, self.group, self.config = policy, cp_group, policy.config
        self.forward_layout = None  # the ZigzagShard of the forward running (local_rows)
        self.params = [p for p in policy.parameters() if p.requires_grad]

    # -- cp_token_logprobs' model ------------------------------------------------------------------------
    def hidden(self, t: Tokens) -> torch.Tensor:
        """This rank's vocabulary slice of the logits of the tokens t (the shard's, with the ring as `attend`)."""
        policy, cfg = self.policy, self.config
        n = t.ids.shape[0]
        if n == 0:  # a rank without tokens still takes part in every ring; Megatron's layers cannot run none
            t = _stand_in(t)
        tokens = prepared(cfg, t, cfg.num_heads // policy.tp_size, cfg.num_kv_heads // policy.tp_size)
        return policy.gpt(t.ids[None], None, None, packed_seq_params=layers.TokenParams(tokens=tokens))[0, :n]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits of some rows of `hidden` (gathered over the tensor-parallel ranks)."""
        return gather_last(features, self.policy.tp)[..., : self.config.vocab_size]

    # -- the policy's logprobs ---------------------------------------------------------------------------
    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None,
                       temperature: float = 1.0) -> torch.Tensor:
        """float32 [B, T-1]: MegatronPolicy.token_logprobs (before its mask), computed over the context-parallel
        ranks; every rank passes the whole batch and gets the whole batch's logprobs."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        b, length = input_ids.shape
        lo, hi = torch.aminmax(input_ids)
        if int(lo) < 0 or int(hi) >= self.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.vocab_size}) in the model input: "
                             "check the tokenizer matches the model's vocab_size")
        lengths = torch.full((b,), length) if lengths is None else lengths.to(input_ids.device)
        if lengths.shape != (b,) or int(lengths.min()) < 1 or int(lengths.max()) > length:
            raise ValueError(f"lengths {lengths.tolist()} must hold one length in 1..{length} per row of the "
                             f"[{b}, {length}] input_ids; pass each sequence's token count")
        rows = packed_rows(lengths, length)
        cu = [0, *torch.cumsum(lengths, 0).tolist()]
        self.forward_layout = ZigzagShard(cu, dist.get_world_size(self.group), dist.get_rank(self.group))
        local, shard = cp_token_logprobs(self, input_ids.reshape(-1)[rows], cu, self.group, temperature)
        whole = shard.gather(local.detach(), self.group)  # the packed row's logprobs, 0 at each sequence's last token
        out = whole.new_zeros(b * length).index_copy(0, rows, whole).view(b, length)[:, :-1]
        if torch.is_grad_enabled() and local.requires_grad:
            out = _Reduced.apply([local, shard.index, rows], self, out, *self.params)
        return out


    def local_rows(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's output of this rank's tokens in the forward running (Megatron's [n, 1, hidden]) as [n, hidden],
        in the shard's local order (a rank without tokens ran a stand-in row: dropped). Bits as they are: a
        token's row is the one cp = 1 computes."""
        return x.detach().reshape(-1, x.shape[-1])[: self.forward_layout.index.shape[0]]


def _stand_in(t: Tokens) -> Tokens:
    """One token in place of none: the layers run it, its attention is zeros (the ring runs with no queries, as
    the other ranks' rings need), and its rows are dropped after the forward."""
    ring = t.attend

    def attend(q, k, v, scale):
        return torch.cat([ring(q[:0], k[:0], v[:0], scale), torch.zeros_like(q)])

    one = t.ids.new_zeros(1)
    return dataclasses.replace(t, ids=one, positions=one, seq_idx=one, attend=attend)


class _Reduced(torch.autograd.Function):
    """Forward: the gathered logprobs [B, T-1]. Backward: this rank's tokens' part of every parameter gradient
    (autograd of its own logprobs, the ring's backward a collective of the group), the parts added over the
    context-parallel ranks in a fixed tree; they reach the parameters as this node's input gradients, so plain
    autograd (and data_parallel's per-share gradients) see the whole sums."""

    @staticmethod
    def forward(ctx, saved, cp: ContextParallel, out, *params):
        ctx.saved, ctx.cp = saved, cp
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        local, index, rows = ctx.saved
        cp = ctx.cp
        row_grad = F.pad(grad, (0, 1)).reshape(-1)[rows]  # [sum(lengths)]: the packed row's order
        parts = torch.autograd.grad(local, cp.params, row_grad[index].to(local.dtype), allow_unused=True)
        return (None, None, None, *tree_reduce(list(parts), cp.params, cp.group))
