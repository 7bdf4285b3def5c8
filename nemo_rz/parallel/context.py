"""Context parallelism: zigzag ring attention over packed sequences, with branch attention for a draft, and a
whole Decoder's learner forward and backward split over the ranks.

Sharding (`ZigzagShard`). A packed row holds sequences back to back (`cu_seqlens`). Each sequence is cut into
blocks of KV_BLOCK tokens, its blocks into 2W chunks of nearly equal size, and rank r holds chunks c and
2W-1-c with c = (r + s) mod W for sequence s: under a causal mask chunk c's queries see few keys and chunk
2W-1-c's many, so the work is balanced; the rotation by s deals sequences shorter than 2W blocks round the
ranks instead of piling them on one. A key block never straddles two ranks.

Arithmetic. Each output row is computed by ops.attention's consistent core (tile_scores, row_max,
tile_partials, merge_partials, tile_output; see its docstring), exactly as ops.attention computes it on one
process: scores of row tiles [R, D] against key blocks [D, KV_BLOCK], the softmax shift m = the row's exact
maximum visible score, [P @ V | sum p] per (tile, block), those partials added in increasing block order
starting from zeros, out = (P @ V) / sum p. A row's bits depend only on its own keys and their blocks (the
row-invariance ops.attention relies on), so the result equals single-process attention bit for bit whatever
the rank count. The ring adds only where a block's products are computed and the order of the merge:
- pass 1 circulates the key blocks: each rank scores its queries against every block it receives and keeps
  the scores; the exact max needs no order;
- pass 2 circulates the value blocks: the [P @ V | sum p] partials, kept with each pair's block index;
- the partials are then added per row in block-index order (`_ordered_sum`), never in ring-arrival order.
Like ops.attention's consistent path (which materialises all pairs of a forward at once), this keeps every
(tile, block) partial of the rank's queries: memory grows with queries x visible keys / KV_BLOCK.

Backward (a ring of its own): key and value blocks circulate once more; each rank recomputes s and p for its
queries (the core's tile_scores and tile_weights), forms dS, and keeps dQ partials; the dK and dV partials of
a block go straight back to the block's owner. Both are added in fixed orders (dQ: by key block; dK, dV: by
query block), so gradients are the same bits for any rank count (1, 2, 4 ... processes). They are the exact
gradients of the forward above; the library backward of ops.attention sums the same terms in other orders
(equal within float32 rounding). It is written out rather than left to autograd over the core: autograd
cannot carry a gradient back over the ring's send/receive, and it would add a key block's contributions from
other ranks' queries in the order its graph happens to visit them, not in a fixed order by query block.

Branch attention (`branch_attention`): a draft's training-time test runs J further steps at every position; the
query of step j (1..J) at position p attends to the main sequence's keys 0..p (blocks before p's own block come
through the ring) followed by its own branch's keys of steps 1..j at p (rank-local). The keys it sees are the
sequence [main 0..p, branch 1..j], cut into KV_BLOCK blocks from 0 like any sequence: so
ops.attention over that sequence, with the query at position p + j, gives the same bits.

Full causal attention only (no sliding window, no sinks), on CPU tensors, with the arithmetic above in either
ops mode; queries and keys of one token share a rank.

A whole Decoder (`cp_token_logprobs`): each rank runs the model's own modules (embedding, norms, projections,
MLPs, LM head and log-softmax, all nemo_rz.ops) on its shard's tokens, and the attention of every layer through
`ring_attention` (the model's Attention hands q, k, v to `Tokens.attend`). The consistent ops compute each
token's row alone, so every rank's logprobs, and the gradients reaching each token's activations, are the bits
one process computes (tests/test_context_parallel.py checks both for 2 and 4 ranks). A parameter's gradient is
a sum over tokens, and each rank's matmuls sum over its own tokens only: `reduce_gradients` gathers the ranks'
partial gradients and adds them in a fixed tree over rank order, so every rank and every run gets the same
bits, equal to one process's sum over all tokens within float32 rounding (under 1e-6 of each parameter's
largest entry in the tests' model). Dense full-attention models only: sliding windows, sinks and mixtures of experts are refused.

A draft's training-time test (`cp_draft_loss`): each rank runs the draft's own layers (DraftHead.run_steps) on its
shard's roots, step 1's attention through `ring_attention` and step s's through `branch_attention` with that
step's queries only (the branch, the root's steps 2..s, is rank-local). Every root's states and loss term are the
bits one process computes, and the loss adds the terms in row order, so it is too; the draft's parameter
gradients (`reduce_gradients`) equal one process's within float32 rounding. DraftHead.training_loss of the
sequences padded into a [B, T] batch runs the same layers and `draft_attention` on one rank (the batch's rows
as a packed row): every root's states are the same bits, and the losses agree within float32 rounding (they
add the terms in other orders).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_rz import ops
from nemo_rz.models.decoder import Decoder, Tokens
from nemo_rz.ops.attention import (
    _EXP_FLOOR,
    KV_BLOCK,
    merge_partials,
    row_max,
    tile_bmm,
    tile_output,
    tile_partials,
    tile_scores,
    tile_weights,
    with_ones,
)
from nemo_rz.ops.attention_plan import tile_rows
from nemo_rz.parallel.tensor import gather_parts, tree_sum

if TYPE_CHECKING:
    from nemo_rz.models.draft import DraftHead

__all__ = ["ZigzagShard", "branch_attention", "check_model", "cp_draft_loss", "cp_token_logprobs", "reduce_gradients",
           "ring_attention", "tree_reduce"]

_RING_TAG, _RETURN_TAG = 11, 12  # point-to-point tags: ring transfers, dK/dV partials on their way home


class ZigzagShard:
    """Which tokens of a packed row rank `rank` of `world` holds (see the module docstring).

    index: global token indices of the local tokens, in local order (x_local = x[index]);
    positions, seq_idx: each local token's position in its sequence and its sequence."""

    def __init__(self, cu_seqlens, world: int, rank: int):
        cu = [int(c) for c in cu_seqlens]
        if len(cu) < 2 or cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens = {cu}: must start at 0 and strictly increase (one entry per sequence boundary)")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of world {world}: need world >= 1 and 0 <= rank < world")
        self.cu_seqlens, self.world, self.rank = tuple(cu), world, rank
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        blocks = [-(-n // KV_BLOCK) for n in lengths]
        first = [sum(blocks[:s]) for s in range(len(blocks))]  # global id of each sequence's block 0
        self.total_blocks = sum(blocks)
        # blocks_of[q]: [n, 3] (sequence, block in sequence, global block id) held by rank q, in local order.
        self.blocks_of = []
        for q in range(world):
            rows = []
            for s, nb in enumerate(blocks):
                first_chunk = (q + s) % world  # rotated per sequence, so that short sequences go round the ranks
                for c in (first_chunk, 2 * world - 1 - first_chunk):
                    rows += [(s, b, first[s] + b) for b in range(c * nb // (2 * world), (c + 1) * nb // (2 * world))]
            self.blocks_of.append(torch.tensor(rows, dtype=torch.long).view(-1, 3))
        mine = self.blocks_of[rank]
        offs = torch.arange(KV_BLOCK)
        seq = mine[:, 0, None].expand(-1, KV_BLOCK)
        pos = mine[:, 1, None] * KV_BLOCK + offs
        real = (pos < torch.tensor(lengths)[seq]).view(-1)
        self.slot = real.nonzero().squeeze(1)  # each local token's slot in the block-padded local layout
        self.seq_idx = seq.reshape(-1)[self.slot]
        self.positions = pos.reshape(-1)[self.slot]
        self.index = torch.tensor(cu[:-1])[self.seq_idx] + self.positions

    @property
    def num_blocks(self) -> int:
        return self.blocks_of[self.rank].shape[0]

    def gather(self, x: torch.Tensor, group=None) -> torch.Tensor:
        """Every rank's local rows of x (dim 0) put back in global token order, on every rank."""
        if self.world == 1:
            return x
        size = max(int(KV_BLOCK * b.shape[0]) for b in self.blocks_of)
        mine = x.new_zeros(size, *x.shape[1:])
        mine[: x.shape[0]] = x
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine, group=group)
        out = x.new_empty(self.cu_seqlens[-1], *x.shape[1:])
        for q, part in enumerate(parts):
            index = ZigzagShard(self.cu_seqlens, self.world, q).index
            out[index] = part[: index.shape[0]]
        return out


def check_model(cfg) -> None:
    """Refuse, in one line, a model whose attention or layers the ring does not compute (a DecoderConfig)."""
    kinds = [name for name, used in (("sliding-window attention", any(w is not None for w in cfg.windows())),
                                     ("attention sinks", cfg.attention_sinks),
                                     ("mixture-of-experts layers", cfg.num_experts > 0)) if used]
    if kinds:
        raise ValueError(f"context parallelism runs dense full-attention decoders; this model has {', '.join(kinds)}: "
                         "run it without context parallelism (megatron.cp=1, or Decoder.token_logprobs)")


def cp_token_logprobs(model: Decoder, input_ids: torch.Tensor, cu_seqlens, group=None,
                      temperature: float = 1.0) -> tuple[torch.Tensor, ZigzagShard]:
    """The decoder's token logprobs of a packed row over the ranks of `group` (None: the default group, or one
    process without torch.distributed). Every rank passes the whole row `input_ids` [T] (T = cu_seqlens[-1]);
    each runs the model on its shard's tokens only (attention through `ring_attention`).

    `model`: a Decoder, or any model with its `config` (a DecoderConfig), `hidden(tokens)` (per-token features
    [n, ...] of a decoder.Tokens whose `attend` computes every layer's attention) and `logits(features)` ([m,
    vocab] of some of those rows): the Megatron learner's policy under megatron.cp (runtime/megatron/context.py).

    Returns (float32 [n] in the shard's local order: log p(token after it | its sequence so far) at
    `temperature`, 0 at each sequence's last token; the shard). Differentiable: after backward each rank
    holds its part of the parameter gradients (`reduce_gradients` adds them up); `shard.gather(logprobs,
    group)` puts every rank's values back in row order."""
    check_model(model.config)
    cu = [int(c) for c in cu_seqlens]
    if input_ids.dim() != 1 or input_ids.is_floating_point() or input_ids.shape[0] != cu[-1]:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} {input_ids.dtype}: need one packed row of token ids "
                         f"[cu_seqlens[-1]] = [{cu[-1]}]")
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    shard = ZigzagShard(cu, world, rank)
    def attend(q, k, v, scale):
        return ring_attention(q, k, v, shard, scale, group)
    hidden = model.hidden(Tokens(input_ids[shard.index], shard.positions, shard.seq_idx, attend=attend))
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    scored = (shard.positions < lengths[shard.seq_idx] - 1).nonzero().squeeze(1)  # tokens with a next token
    targets = input_ids[shard.index[scored] + 1]
    lp = ops.token_logprobs(model.logits(hidden.index_select(0, scored)), targets, temperature)
    return lp.new_zeros(hidden.shape[0]).index_copy(0, scored, lp), shard


def cp_draft_loss(draft: DraftHead, target: Decoder, aux: torch.Tensor, final: torch.Tensor | None,
                  input_ids: torch.Tensor, mask: torch.Tensor, cu_seqlens, steps: int, temperature: float = 1.0,
                  group=None, rollout_logprobs: torch.Tensor | None = None):
    """A draft's training-time-test loss (as DraftHead.training_loss computes it) of a packed row over the ranks
    of `group` (None: the default group, or one process without torch.distributed).

    Every rank passes the whole row: input_ids [T] and mask [T] (mask[i]: the token after token i is trained,
    the layout of cp_token_logprobs' logprobs; a sequence's last entry is ignored); and its own tokens' target
    features in the shard's local order (what `aux_features(target, layers, final=True)` collects while the
    target runs under cp_token_logprobs): aux [n, len(aux_layers) * H], and final [n, H] for distillation
    (None: hard labels). The rank's roots are its own tokens: step s of root t sits at position t + s - 1,
    reads token t + s and predicts token t + s + 1; the draft's layers run on them with step 1's attention
    through `ring_attention` and step s > 1's through `branch_attention` (the branch: that root's steps 2..s).

    With `rollout_logprobs` [T] (the target's logprobs of the row's tokens at `temperature`, in the layout of
    `mask`), each step also reports its estimated acceptance rate draft_accept_s, as DraftHead.training_loss does.

    Returns (this rank's part of the loss: its roots' terms, differentiable; backward on every rank, then
    `reduce_gradients(draft, group)`; the loss, every root's term added in row order: the same bits on every
    rank and for any rank count; per-step metrics draft_loss_s (and draft_accept_s), the same bits as
    DraftHead.training_loss of the row's sequences padded into a batch), or (None, None, {}) where no step has a
    trained token. The Megatron learner's co-trained draft runs it under megatron.cp (algorithms.draft)."""
    cu = [int(c) for c in cu_seqlens]
    total = cu[-1]
    if input_ids.dim() != 1 or input_ids.is_floating_point() or input_ids.shape[0] != total or mask.shape != (total,):
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and mask {tuple(mask.shape)}: need one packed row of "
                         f"token ids and its mask, both [cu_seqlens[-1]] = [{total}]")
    if steps < 1:
        raise ValueError(f"draft.steps = {steps}: must be >= 1")
    world, rank = (dist.get_world_size(group), dist.get_rank(group)) if dist.is_initialized() else (1, 0)
    shard = ZigzagShard(cu, world, rank)
    n = shard.index.shape[0]
    for name, x in (("aux", aux), ("final", final)) if final is not None else (("aux", aux),):
        if x is None or x.dim() != 2 or x.shape[0] != n or not bool(torch.isfinite(x).all()):
            raise ValueError(f"{name} {None if x is None else tuple(x.shape)}: need this rank's {n} tokens' finite target "
                             "features, one row each in the shard's local order")
    if rollout_logprobs is not None and rollout_logprobs.shape != (total,):
        raise ValueError(f"rollout_logprobs {tuple(rollout_logprobs.shape)}: need the row's logprobs [cu_seqlens[-1]] = "
                         f"[{total}], in the layout of mask")
    lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
    steps = min(steps, int(lengths.max()) - 2)  # step s needs a sequence of s + 2 tokens
    if steps < 1:
        return None, None, {}
    seq_end = torch.tensor(cu[1:]).repeat_interleave(lengths)  # each token's sequence end
    at = torch.arange(total)
    if final is not None:
        final = shard.gather(final, group)  # root t's step s learns the target's distribution at token t + s
    def ahead(s):  # token t + s (clamped past the row's end)
        return input_ids[(at + s).clamp(max=total - 1)]
    reads = [torch.where(at + s < seq_end, ahead(s), 0)[shard.index] for s in range(1, steps + 1)]
    attend = functools.partial(draft_attention, shard=shard, group=group)
    metrics, terms = {}, []
    for s, x in draft.run_steps(target, draft.fc(aux), reads, shard.positions, attend):
        labels = draft.draft_ids(ahead(s + 1))
        valid = (at + s + 1 < seq_end) & mask[(at + s).clamp(max=total - 1)].bool()
        if final is None:
            valid = valid & (labels >= 0)
        count = int(valid.sum())
        if count == 0:
            continue
        rows = valid[shard.index].nonzero().squeeze(1)
        mine = labels[shard.index[rows]]
        term, logq = draft.token_losses(target, x.index_select(0, rows), temperature, mine,
                                        None if final is None else final.index_select(0, shard.index[rows] + s))
        everyone = shard.gather(term.new_zeros(n).index_copy(0, rows, term.detach()), group)
        step_loss = everyone[valid].sum() / count
        metrics[f"draft_loss_{s}"] = float(step_loss)
        terms.append((term.sum() / count, step_loss))
        if rollout_logprobs is not None:  # E_{x~p} min(1, q(x)/p(x)), q = 0 outside the draft vocabulary
            with torch.no_grad():
                q = logq.gather(1, mine.clamp(min=0)[:, None]).squeeze(1)
                q = torch.where(mine >= 0, q, torch.full_like(q, -math.inf))
                p = rollout_logprobs[(at + s).clamp(max=total - 1)][shard.index[rows]]
                accept = torch.exp(torch.clamp(q - p, max=0.0))
                everyone = shard.gather(accept.new_zeros(n).index_copy(0, rows, accept), group)
                metrics[f"draft_accept_{s}"] = float(everyone[valid].mean())
    if not terms:
        return None, None, {}
    # Every rank runs backward through every step's attention (the ring's backward is collective): zeros of
    # the last step's states join the part, whether or not this rank has a trained token.
    part = (sum(t for t, _ in terms) + 0.0 * x.sum()) / len(terms)
    loss = sum(term for _, term in terms) / len(terms)
    return part, loss, metrics


def draft_attention(q, keys, values, scale, shard: ZigzagShard, group):
    """DraftHead._layer's attention for a shard's roots: step 1 through the ring; step s > 1 as the only query
    step (the last) of a branch of s - 1 steps."""
    if len(keys) == 1:
        return ring_attention(q, keys[0], values[0], shard, scale, group)
    branch = torch.stack(keys[1:]), torch.stack(values[1:])
    return branch_attention(None, keys[0], values[0], q[None], *branch, shard, scale, group)[1][0]


def reduce_gradients(module: torch.nn.Module, group=None) -> None:
    """Replace each parameter's gradient on every rank of `group` by the sum of all ranks' gradients, added in a
    fixed tree over rank order (`tree_reduce`), never in arrival order: the same bits on every rank and in every
    run. A parameter without a gradient counts as zeros."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for p, g in zip(params, tree_reduce([p.grad for p in params], params, group)):
        p.grad = g


def tree_reduce(tensors: list[torch.Tensor | None], like: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Every rank's `tensors` (one per entry of `like`, None: zeros of its shape) summed over the ranks of `group`
    in a fixed tree over rank order (parallel.tensor.tree_sum), one flat gather per dtype: the same bits on every
    rank and in every run. Holds every rank's tensors at once (world copies), which suits this project's CPU
    learners. One process (or a group of one): the tensors themselves (zeros for None)."""
    out = [torch.zeros_like(x) if t is None else t for t, x in zip(tensors, like, strict=True)]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return out
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(out):
        by_dtype.setdefault(t.dtype, []).append(i)
    for index in by_dtype.values():
        flat = torch.cat([out[i].reshape(-1) for i in index])
        total = tree_sum(gather_parts(flat, group))
        for i, g in zip(index, total.split([out[i].numel() for i in index])):
            out[i] = g.view_as(out[i])
    return out


def ring_attention(q, k, v, shard: ZigzagShard, scale: float, group=None) -> torch.Tensor:
    """Causal attention of the local tokens q [n, H, D], k, v [n, Hkv, D] (GQA: H a multiple of Hkv), all in
    `shard`'s local order, against every earlier token of their sequences on all ranks of `group` (None: the
    default group). Returns [n, H, D]; differentiable in q, k and v (each rank gets its own tokens' gradients)."""
    empty_q, empty_kv = q.new_zeros(0, *q.shape), k.new_zeros(0, *k.shape)
    return branch_attention(q, k, v, empty_q, empty_kv, empty_kv, shard, scale, group)[0]


def branch_attention(q, k, v, q_branch, k_branch, v_branch, shard: ZigzagShard, scale: float, group=None):
    """Main-sequence attention as in `ring_attention`, plus J branch steps at every local position:
    q_branch [J, n, H, D], k_branch, v_branch [J, n, Hkv, D] (step j = 1..J in row j - 1). The step-j query at
    position p sees the main keys 0..p of its sequence (on any rank), then the branch keys of steps 1..j at p.
    Returns (main out [n, H, D], branch out [J, n, H, D]), differentiable in all six inputs.

    Queries of the last steps only (a draft's training-time test computes one step at a time): q None and
    q_branch [Jq, n, H, D] with Jq <= J, the queries of steps J - Jq + 1..J; returns (None, their outputs). The
    outputs are the same bits; gradients are exact and rank-count independent, but their sums run over the
    rows computed, so they may differ in the last bits from a call with every step's queries."""
    _check(q, k, v, q_branch, k_branch, v_branch, shard)
    world, rank = _group_shape(shard, group)
    if (world, rank) != (shard.world, shard.rank):
        raise ValueError(f"the shard is rank {shard.rank} of {shard.world} but the process group has this process "
                         f"as rank {rank} of {world}: build the ZigzagShard from the group's rank and size")
    queries = q_branch if q is None else torch.cat([q.unsqueeze(0), q_branch])
    plan = _plan(shard.cu_seqlens, shard.world, shard.rank, queries.shape[2], k.shape[1], k.shape[2],
                 k_branch.shape[0], queries.shape[0])
    out = _BranchAttention.apply(plan, group, scale, queries, k, v, k_branch, v_branch)
    return (None, out) if q is None else (out[0], out[1:])


def _check(q, k, v, qb, kb, vb, shard: ZigzagShard) -> None:
    n = shard.index.shape[0]
    main = qb[0] if q is None and qb.dim() == 4 and qb.shape[0] else q
    if main is None or main.dim() != 3 or k.shape != v.shape or k.dim() != 3 or main.shape[0] != n or k.shape[0] != n:
        raise ValueError(f"q {None if main is None else tuple(main.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: "
                         f"need q [n, H, D] (or q None and branch queries) and k, v [n, Hkv, D] with n = {n}, the "
                         "shard's local token count")
    if main.shape[2] != k.shape[2] or main.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(main.shape)} and k {tuple(k.shape)}: head dims must match and H be a multiple of Hkv")
    if (qb.shape[1:] != main.shape or kb.shape[1:] != k.shape or vb.shape != kb.shape
            or not (qb.shape[0] == kb.shape[0] if q is not None else 1 <= qb.shape[0] <= kb.shape[0])):
        raise ValueError(f"branch q {tuple(qb.shape)}, k {tuple(kb.shape)}, v {tuple(vb.shape)}: need [J, *main shape] "
                         "(with q None: branch queries of the last 1..J steps)")
    for name, t in (("q", main), ("k", k), ("v", v), ("q_branch", qb), ("k_branch", kb), ("v_branch", vb)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}: context-parallel attention runs on CPU tensors (gloo)")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} holds non-finite values: attention inputs must be finite")


def _group_shape(shard: ZigzagShard, group) -> tuple[int, int]:
    if shard.world == 1 and (group is None or not dist.is_initialized()):
        return 1, 0
    if not dist.is_initialized():
        raise ValueError(f"a shard of {shard.world} ranks needs torch.distributed initialised (init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


# -- plan: who computes which (query tile, key block) pair ---------------------------------------------------


class _Pairs:
    """Full pairs between the query blocks of one rank and the key blocks of another (key block before query
    block, same sequence), one per (query block, key block, kv head): a, b (local block indices on each side),
    head, and the global ids of both blocks."""

    def __init__(self, q_blocks: torch.Tensor, k_blocks: torch.Tensor, kv_heads: int):
        see = (q_blocks[:, None, 0] == k_blocks[None, :, 0]) & (k_blocks[None, :, 1] < q_blocks[:, None, 1])
        a, b = see.nonzero(as_tuple=True)
        self.a = a.repeat_interleave(kv_heads)
        self.b = b.repeat_interleave(kv_heads)
        self.head = torch.arange(kv_heads).repeat(a.shape[0])
        self.a_gid, self.b_gid = q_blocks[self.a, 2], k_blocks[self.b, 2]
        self.n = self.a.shape[0]


class _Plan:
    """Bookkeeping of one rank: the query row table, full pairs per source rank, rank-local tail pairs.

    Query rows: the query steps (main = step 0 and branch steps 1..J, or the last `queries` of them) of every
    local slot (KV_BLOCK slots per local block, the last block of a sequence padded), laid out as [block, kv
    head, query step, offset, head in group]: the rows of a
    (block, kv head) group are contiguous and cut into tiles of R rows. Row n_rows is a dump for tile padding.
    Key pool: [step, block, offset, kv head] rows of keys (values alike), then one zero row.
    """

    def __init__(self, cu_seqlens, world, rank, heads, kv_heads, head_dim, steps, queries):
        shard = ZigzagShard(cu_seqlens, world, rank)
        self.world, self.rank, self.steps = world, rank, steps
        self.queries, self.first = queries, steps + 1 - queries  # query steps first..steps
        self.heads, self.kv_heads, self.g = heads, kv_heads, heads // kv_heads
        self.nbl = nbl = shard.num_blocks
        self.nb_max = max(b.shape[0] for b in shard.blocks_of)
        self.slot = shard.slot
        # The tile height ops.attention takes for a block of training queries (any height gives each row the
        # same bits where the batched products were probed row-invariant).
        self.R = R = tile_rows(torch.zeros(KV_BLOCK, dtype=torch.long), heads, kv_heads, head_dim, torch.float32)
        self.rows_g = queries * KV_BLOCK * self.g  # rows per (block, kv head) group, a multiple of R
        self.n_rows = nbl * kv_heads * self.rows_g
        self.pool_rows = (steps + 1) * nbl * KV_BLOCK * kv_heads
        mine = shard.blocks_of[rank]
        self.full = [_Pairs(mine, shard.blocks_of[src], kv_heads) for src in range(world)]  # my queries, src's keys
        self.incoming = [_Pairs(shard.blocks_of[src], mine, kv_heads) for src in range(world)]  # src's queries, my keys
        # A position's branch tails hold its query steps' rows only: the height ops.attention takes for that many.
        branch_rows = tile_rows(torch.zeros(steps + 1 - max(self.first, 1), dtype=torch.long), heads, kv_heads, head_dim,
                                torch.float32)
        self._tails(mine, R, branch_rows)

    def full_rows(self, pairs: _Pairs) -> torch.Tensor:
        """[pairs, rows_g]: the query rows of each pair's (block, kv head) group."""
        return ((pairs.a * self.kv_heads + pairs.head) * self.rows_g)[:, None] + torch.arange(self.rows_g)

    def key_rows(self, pairs: _Pairs) -> torch.Tensor:
        """[pairs, KV_BLOCK]: the owner's key pool rows of each pair's key block (main step)."""
        return ((pairs.b * KV_BLOCK)[:, None] + torch.arange(KV_BLOCK)) * self.kv_heads + pairs.head[:, None]

    def _row(self, a, head, step, off, e):
        return (((a * self.kv_heads + head) * self.queries + step - self.first) * KV_BLOCK + off) * self.g + e

    def _pool(self, step, a, off, head):
        return ((step * self.nbl + a) * KV_BLOCK + off) * self.kv_heads + head

    def _tails(self, mine: torch.Tensor, R: int, Rb: int) -> None:
        """Rank-local pairs (`tails`: main tails in tiles of R rows, branch tails of Rb): each block's main queries
        against the block itself (causal), and each position's branch queries against the blocks of [main keys
        of the block up to p, branch keys at p] (of the query steps only). Per pair: rows / dest [P, R], keys
        [P, KV_BLOCK] (pool rows), count [P, R] (visible keys: a prefix), the block's global id, its block
        index within the row's key sequence, and its ordinal among its block's tails."""
        J, g, H, nbl = self.steps, self.g, self.kv_heads, self.nbl
        first = max(self.first, 1)  # the first branch step with queries
        off = torch.arange(KV_BLOCK)
        parts = []
        if self.first == 0:  # main tails: (block a, kv head h, tile t); rows of step 0 are contiguous in the group
            grid = torch.meshgrid(torch.arange(nbl), torch.arange(H), torch.arange(KV_BLOCK * g // R), indexing="ij")
            a, h, t = (x.reshape(-1) for x in grid)
            within = t[:, None] * R + torch.arange(R)  # (offset, head in group) index within step 0 of the group
            rows = self._row(a, h, 0, 0, 0)[:, None] + within
            keys = self._pool(0, a[:, None], off, h[:, None])
            parts.append((a, rows, rows, keys, within // g + 1, torch.zeros_like(a), t))
        if J:
            tail_blocks = -(-(KV_BLOCK + J) // KV_BLOCK)
            n_tiles = -(-((J + 1 - first) * g) // Rb)
            a, o, h, tb, tt = (x.reshape(-1) for x in torch.meshgrid(
                torch.arange(nbl), off, torch.arange(H), torch.arange(tail_blocks), torch.arange(n_tiles), indexing="ij"))
            keep = o + 1 + J > tb * KV_BLOCK  # the block holds a key some row of the tile sees
            a, o, h, tb, tt = a[keep], o[keep], h[keep], tb[keep], tt[keep]
            slot = tt[:, None] * Rb + torch.arange(Rb)  # (step - first, head in group) index, then padding
            pad = slot >= (J + 1 - first) * g
            slot = slot.masked_fill(pad, 0)  # padding computes the group's first row again, into the dump
            step = slot // g + first
            rows = self._row(a[:, None], h[:, None], step, o[:, None], slot % g)
            dest = rows.masked_fill(pad, self.n_rows)
            v = tb[:, None] * KV_BLOCK + off  # virtual key position
            o_, a_, h_ = o[:, None], a[:, None], h[:, None]
            keys = torch.where(v <= o_, self._pool(0, a_, v.clamp(max=KV_BLOCK - 1), h_),
                               torch.where(v <= o_ + J, self._pool((v - o_).clamp(1, J), a_, o_, h_), self.pool_rows))
            count = (o_ + 1 + step - tb[:, None] * KV_BLOCK).clamp(0, KV_BLOCK)
            ordinal = KV_BLOCK * g // R + (o * tail_blocks + tb) * n_tiles + tt
            parts.append((a, rows, dest, keys, count, 1 + tb, ordinal))
        self.tails = [_Tails(mine[a, 2], *rest) for a, *rest in parts]
        self.tail_stride = 2 + max(int(t.block.max()) if t.block.numel() else 0 for t in self.tails)
        self.tail_ordinals = 1 + max(int(t.ordinal.max()) if t.ordinal.numel() else 0 for t in self.tails)

    # Ordering keys. Per query row: key blocks in increasing order (full blocks by global id, then the row's
    # tail blocks). Per key row: contributions by query block, full pair first, then the block's tails.
    def row_key_full(self, pairs: _Pairs) -> torch.Tensor:
        return pairs.b_gid * self.tail_stride

    def row_key_tail(self, tails: _Tails) -> torch.Tensor:
        return tails.gid * self.tail_stride + tails.block

    def key_key_full(self, pairs: _Pairs) -> torch.Tensor:
        return pairs.a_gid * (1 + self.tail_ordinals)

    def key_key_tail(self, tails: _Tails) -> torch.Tensor:
        return tails.gid * (1 + self.tail_ordinals) + 1 + tails.ordinal


class _Tails:
    """One batch of rank-local tail pairs, tiles of R = rows.shape[1] rows (see _Plan._tails)."""

    def __init__(self, gid, rows, dest, keys, count, block, ordinal):
        self.gid, self.rows, self.dest, self.keys, self.count, self.block, self.ordinal = gid, rows, dest, keys, count, block, ordinal
        self.R = rows.shape[1]

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(visible 0/1, bias 0/-inf) [P, R, KV_BLOCK] (made per call: they are large)."""
        visible = (torch.arange(KV_BLOCK) < self.count[..., None]).float()
        return visible, torch.zeros_like(visible).masked_fill_(visible == 0, float("-inf"))


@functools.lru_cache(maxsize=8)
def _plan(cu_seqlens, world, rank, heads, kv_heads, head_dim, steps, queries) -> _Plan:
    return _Plan(cu_seqlens, world, rank, heads, kv_heads, head_dim, steps, queries)


# -- arithmetic -----------------------------------------------------------------------------------------------


def _ordered_sum(n_rows: int, parts) -> torch.Tensor:
    """Sum of partial rows into n_rows rows: parts are (values [P, r, C], dest rows [P, r], key [P]); the
    contributions to a row are added one after another (ops.attention's merge_partials) in increasing key,
    never in the order the ring computed them."""
    dest = torch.cat([d.reshape(-1) for _, d, _ in parts])
    key = torch.cat([k[:, None].expand(d.shape).reshape(-1) for _, d, k in parts])
    order = torch.argsort(key, stable=True)
    place = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0]))
    width = parts[0][0].shape[-1]
    values, start = parts[0][0].new_empty(order.shape[0], width), 0
    for v, _, _ in parts:  # each part straight to its sorted place: one copy
        n = v.numel() // width
        values.index_copy_(0, place[start : start + n], v.reshape(n, width))
        start += n
    return merge_partials(n_rows, dest[order], values)


def _ring(tensors: list[torch.Tensor], plan: _Plan, group):
    """Yield (step, source rank, its tensors) for every rank, this rank's own first; each rank passes what it
    holds to the next while the current step is computed."""
    current = tensors
    for step in range(plan.world):
        works, incoming = [], None
        if step + 1 < plan.world:
            incoming = [torch.empty_like(t) for t in current]
            works = [dist.isend(t, group=group, group_dst=(plan.rank + 1) % plan.world, tag=_RING_TAG) for t in current]
            works += [dist.irecv(t, group=group, group_src=(plan.rank - 1) % plan.world, tag=_RING_TAG) for t in incoming]
        yield step, (plan.rank - step) % plan.world, current
        for w in works:
            w.wait()
        current = incoming


def _blocks(pool: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The main keys (or values) of the local blocks as [nb_max, KV_BLOCK, Hkv, D] (zero blocks past nbl)."""
    main = pool[: plan.nbl * KV_BLOCK * plan.kv_heads].view(plan.nbl, KV_BLOCK, plan.kv_heads, pool.shape[-1])
    return F.pad(main, (0, 0, 0, 0, 0, 0, 0, plan.nb_max - plan.nbl)).contiguous()


def _pair_keys(blocks: torch.Tensor, pairs: _Pairs) -> torch.Tensor:
    """[pairs, KV_BLOCK, D]: each pair's key (or value) block from a rank's blocks."""
    return blocks[pairs.b, :, pairs.head]


def _tiles(x: torch.Tensor, per_pair: int) -> torch.Tensor:
    """Repeat each pair's [r, c] operand for its `per_pair` tiles, as one contiguous batch."""
    return x.unsqueeze(1).expand(-1, per_pair, -1, -1).reshape(-1, *x.shape[1:])


def _key_tiles(kp: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """The pairs' key blocks [P, KV_BLOCK, D] for each of their tiles [P * tiles, KV_BLOCK, D], as a view of
    contiguous [D, KV_BLOCK] blocks (the layout tile_scores multiplies by: no second copy there)."""
    return _tiles(kp.transpose(1, 2), plan.rows_g // plan.R).transpose(1, 2)


def _rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x's rows at index [...]: [*index.shape, *x.shape[1:]]."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def _layout(steps: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[steps, n, h, D] -> rows [step, slot, h, D] in float32 (slots of padding tokens are zero)."""
    out = steps.new_zeros(steps.shape[0], plan.nbl * KV_BLOCK, *steps.shape[2:], dtype=torch.float32)
    return out.index_copy_(1, plan.slot, steps.float())


def _query_rows(queries: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Queries [query steps, n, H, D] (or their gradients) as the plan's row table [n_rows + 1, D] (last row:
    the dump, zero)."""
    s = _layout(queries, plan)
    d = s.shape[-1]
    rows = s.view(plan.queries, plan.nbl, KV_BLOCK, plan.kv_heads, plan.g, d).permute(1, 3, 0, 2, 4, 5)
    return F.pad(rows.reshape(-1, d), (0, 0, 0, 1))


def _unrows(rows: torch.Tensor, plan: _Plan, dtype) -> torch.Tensor:
    d = rows.shape[-1]
    x = rows[: plan.n_rows].view(plan.nbl, plan.kv_heads, plan.queries, KV_BLOCK, plan.g, d).permute(2, 0, 3, 1, 4, 5)
    return x.reshape(plan.queries, plan.nbl * KV_BLOCK, plan.heads, d).index_select(1, plan.slot).to(dtype)


def _key_pool(x, xb, plan: _Plan) -> torch.Tensor:
    """Keys (or values) [n, Hkv, D] and the branch's [J, n, Hkv, D] as the plan's pool [pool_rows + 1, D] (last
    row zero)."""
    s = _layout(torch.cat([x.unsqueeze(0), xb]), plan)
    return F.pad(s.reshape(-1, s.shape[-1]), (0, 0, 0, 1))


def _unpool(pool: torch.Tensor, plan: _Plan, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    d = pool.shape[-1]
    x = pool[: plan.pool_rows].view(plan.steps + 1, plan.nbl * KV_BLOCK, plan.kv_heads, d).index_select(1, plan.slot).to(dtype)
    return x[0], x[1:]


class _BranchAttention(torch.autograd.Function):
    """Every (query tile, key block) pair of the rank's queries by ops.attention's core: full pairs as the ring
    brings their key and value blocks, the rank-local tails after them; partials merged in block order."""

    @staticmethod
    def forward(ctx, plan: _Plan, group, scale, queries, k, v, kb, vb):
        d = queries.shape[-1]
        Q = _query_rows(queries, plan) * scale
        kpool, vpool = _key_pool(k, kb, plan), _key_pool(v, vb, plan)
        tiles = plan.rows_g // plan.R
        m = Q.new_full((plan.n_rows + 1,), float("-inf"))

        # Pass 1, keys: scores of every pair, and each row's exact maximum (a max needs no order).
        scores = []
        for _, src, (kblocks,) in _ring([_blocks(kpool, plan)], plan, group):
            pairs = plan.full[src]
            if pairs.n == 0:
                scores.append(None)
                continue
            rows = plan.full_rows(pairs).view(-1, plan.R)
            s = tile_scores(_rows_of(Q, rows), _key_tiles(_pair_keys(kblocks, pairs), plan))
            row_max(m, rows.reshape(-1), s)
            scores.append(s)
        tail_scores = []
        for t in plan.tails:
            visible, bias = t.masks()
            s_tail = tile_scores(_rows_of(Q, t.rows), _rows_of(kpool, t.keys), bias)
            row_max(m, t.dest.reshape(-1), s_tail)
            tail_scores.append((s_tail, visible))

        # Pass 2, values: [P @ V | sum p] of every pair, kept with its block's place in the row's order.
        parts = []
        for step, src, (vblocks,) in _ring([_blocks(vpool, plan)], plan, group):
            pairs, s = plan.full[src], scores[step]
            if s is None:
                continue
            rows = plan.full_rows(pairs).view(-1, plan.R)
            pv = tile_partials(s, _rows_of(m, rows), _tiles(with_ones(_pair_keys(vblocks, pairs)), tiles))
            parts.append((pv, rows, plan.row_key_full(pairs).repeat_interleave(tiles)))
            scores[step] = None
        for t, (s_tail, visible) in zip(plan.tails, tail_scores):
            pv = tile_partials(s_tail, _rows_of(m, t.dest), with_ones(_rows_of(vpool, t.keys)), visible)
            parts.append((pv, t.dest, plan.row_key_tail(t)))
        acc = _ordered_sum(plan.n_rows + 1, parts)
        out = tile_output(acc, d)

        ctx.plan, ctx.group, ctx.scale = plan, group, scale
        ctx.dtypes = (queries.dtype, k.dtype, v.dtype)
        ctx.save_for_backward(Q, kpool, vpool, m, out, acc[:, d])
        return _unrows(out, plan, queries.dtype)

    @staticmethod
    def backward(ctx, dout):
        plan, group = ctx.plan, ctx.group
        Q, kpool, vpool, m, out, denom = ctx.saved_tensors
        d = Q.shape[-1]
        tiles = plan.rows_g // plan.R
        dO = _query_rows(dout, plan) / denom[:, None]
        delta = (_query_rows(dout, plan) * out).sum(-1) / denom
        dO[-1], delta[-1] = 0.0, 0.0  # the dump row: padding of tail tiles contributes nothing

        def grads(s, rows, v, visible=None):
            """dS and p of one batch of pairs: s [P, R, KV_BLOCK] scores of query rows `rows` [P, R]."""
            shifted = s - _rows_of(m, rows).unsqueeze(-1)
            p = tile_weights(shifted, visible)
            dp = tile_bmm(_rows_of(dO, rows), v.transpose(1, 2)) - _rows_of(delta, rows).unsqueeze(-1)
            return p * dp * (shifted >= _EXP_FLOOR), p  # no gradient where the exp's input was clamped

        dq_parts, dk_parts, dv_parts, sent = [], [], [], []
        for step, src, (kblocks, vblocks) in _ring([_blocks(kpool, plan), _blocks(vpool, plan)], plan, group):
            pairs = plan.full[src]
            if pairs.n:
                rows = plan.full_rows(pairs)
                kp, vp = _pair_keys(kblocks, pairs), _pair_keys(vblocks, pairs)
                qg = _rows_of(Q, rows)
                s = tile_scores(qg.view(-1, plan.R, d), _key_tiles(kp, plan))
                ds, p = grads(s, rows.view(-1, plan.R), _tiles(vp, tiles))
                ds, p = ds.view(pairs.n, plan.rows_g, KV_BLOCK), p.view(pairs.n, plan.rows_g, KV_BLOCK)
                dq_parts.append((tile_bmm(ds, kp), rows, plan.row_key_full(pairs)))
                dkv = torch.stack([tile_bmm(ds.transpose(1, 2), qg), tile_bmm(p.transpose(1, 2), _rows_of(dO, rows))], 1)
                if src == plan.rank:
                    dk_parts.append((dkv[:, 0], plan.key_rows(pairs), plan.key_key_full(pairs)))
                    dv_parts.append((dkv[:, 1], plan.key_rows(pairs), plan.key_key_full(pairs)))
                else:  # the block's owner adds them up
                    sent.append((dkv, dist.isend(dkv, group=group, group_dst=src, tag=_RETURN_TAG)))
            origin = (plan.rank + step) % plan.world  # whose queries scored my blocks at this step
            back = plan.incoming[origin]
            if step and back.n:
                buf = Q.new_empty(back.n, 2, KV_BLOCK, d)
                dist.irecv(buf, group=group, group_src=origin, tag=_RETURN_TAG).wait()
                dk_parts.append((buf[:, 0], plan.key_rows(back), plan.key_key_full(back)))
                dv_parts.append((buf[:, 1], plan.key_rows(back), plan.key_key_full(back)))
        for _, work in sent:
            work.wait()

        for t in plan.tails:
            kt, vt, q_tail = _rows_of(kpool, t.keys), _rows_of(vpool, t.keys), _rows_of(Q, t.rows)
            visible, bias = t.masks()
            ds, p = grads(tile_scores(q_tail, kt, bias), t.dest, vt, visible)
            dq_parts.append((tile_bmm(ds, kt), t.dest, plan.row_key_tail(t)))
            key_key = plan.key_key_tail(t)
            dk_parts.append((tile_bmm(ds.transpose(1, 2), q_tail), t.keys, key_key))
            dv_parts.append((tile_bmm(p.transpose(1, 2), _rows_of(dO, t.dest)), t.keys, key_key))

        dq = _unrows(_ordered_sum(plan.n_rows + 1, dq_parts) * ctx.scale, plan, ctx.dtypes[0])
        dk, dkb = _unpool(_ordered_sum(plan.pool_rows + 1, dk_parts), plan, ctx.dtypes[1])
        dv, dvb = _unpool(_ordered_sum(plan.pool_rows + 1, dv_parts), plan, ctx.dtypes[2])
        return None, None, None, dq, dk, dv, dkb, dvb
