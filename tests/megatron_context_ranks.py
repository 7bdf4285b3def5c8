"""The ranks of test_megatron_context.py: ONE launch of 2 ranks (launch.start), megatron.cp = 2, every check.

Both ranks: a MegatronPolicy's logprobs of a batch of sequences of different lengths (some longer than one key
block, so their attention crosses the ranks) and of one short sequence (rank 1 holds no token of it); the
parameter gradients of a fixed weighting of the logprobs, twice; then the same with the ring's partials merged in
arrival order (the negative control), and the refusals (fast kernels, a sliding window). Then a learner update
(rank 0 drives, rank 1 follows), and one with a co-trained draft (each rank training its copy on its own tokens),
then again without the draft's branch attention. Rank 0 saves what both ranks got to argv[1]."""
import sys

import torch
import torch.distributed as dist
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.algorithms.advantages import group_advantages
from nemo_rz.algorithms.draft import DraftTrainer
from nemo_rz.generation.packing import Packed
from nemo_rz.models.draft import DraftHead
from nemo_rz.parallel import context as ring
from nemo_rz.parallel.tensor import gather_parts
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.learner import MegatronLearner
from nemo_rz.runtime.megatron.model import MegatronPolicy

VOCAB = 47
LENGTHS = (150, 9, 45, 200, 2, 70)  # up to 7 key blocks of 32


def model():
    return tiny_model(0, vocab_size=VOCAB)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(seed))
    return ids, torch.tensor(LENGTHS)


def loss_weights() -> torch.Tensor:
    return torch.randn(len(LENGTHS), max(LENGTHS) - 1, generator=torch.Generator().manual_seed(3))


def rl_batch() -> tuple[Packed, torch.Tensor]:
    ids, lengths = batch(2)
    t = torch.arange(max(LENGTHS) - 1)[None, :]
    mask = (t >= 3) & (t < lengths[:, None] - 1)
    rollout = -torch.rand(len(LENGTHS), max(LENGTHS) - 1, generator=torch.Generator().manual_seed(4)) * mask
    return Packed(ids, lengths, rollout, mask.float()), group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 3)


def learner(mirror, layout: Layout) -> MegatronLearner:
    return MegatronLearner(mirror, layout, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})


def draft(mirror) -> DraftTrainer:
    """A co-trained draft reading both layers (their outputs are on every rank's tokens) and the final norm, three
    training-time-test steps."""
    torch.manual_seed(5)
    return DraftTrainer(DraftHead(mirror.config, (0, 1), num_layers=1), "cotrain", 1e-3, 1.0, steps=3, k=3, grad_clip=1.0)


def policy(m, mode: str = "consistent") -> MegatronPolicy:
    with ops.use_kernels(mode):
        p = MegatronPolicy(m.config)
    p.load_state_dict(m.state_dict())
    return p


def grads(p: MegatronPolicy, ids, lengths) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logprobs and the parameter gradients of sum(logprobs * loss_weights())."""
    p.zero_grad(set_to_none=True)
    lp = p.token_logprobs(ids, lengths)
    (lp * loss_weights()[: ids.shape[0], : ids.shape[1] - 1]).sum().backward()
    return lp.detach(), [q.grad.clone() for q in p.parameters()]


def _arrival_order(n_rows, parts):
    """parallel.context._ordered_sum's partials added in the order the ring computed them, not by key block."""
    values = torch.cat([v.reshape(-1, v.shape[-1]) for v, _, _ in parts])
    dest = torch.cat([d.reshape(-1) for _, d, _ in parts])
    return values.new_zeros(n_rows, values.shape[-1]).index_add_(0, dest, values)


def _without_branch(q, keys, values, scale, shard, group):
    """parallel.context.draft_attention without the rank-local branch: the negative control, each step s > 1 of
    the training-time test attending over the ring to its own step's entries only."""
    return ring.ring_attention(q, keys[-1], values[-1], shard, scale, group)


_draft_attention = ring.draft_attention


def _cotrained(tag: str):
    """One learner update over the 2 ranks with a co-trained draft, rank 0 driving: every rank's draft weights
    (rank 0's trainer, rank 1's copy) and rank 0's metrics and draft gradients."""
    rank = dist.get_rank()
    with ops.use_kernels("consistent"):
        if rank:
            trainer = MegatronLearner.follow().draft
            got = {}
        else:
            mirror = model()
            lrn = learner(mirror, Layout(cp=2))
            lrn.add_aux_loss(draft(mirror))
            metrics, _ = lrn.rl_step(*rl_batch())
            trainer = lrn.draft
            got = {f"{tag}_metrics": {k: v for k, v in metrics.items() if k.startswith("draft")},
                   f"{tag}_grads": {n: q.grad.clone() for n, q in trainer.draft.named_parameters()}}
            lrn.stop()
    weights = [None, None]
    dist.all_gather_object(weights, trainer.shipped())
    got[f"{tag}_weights"] = weights
    return got


def _refusal(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return ""


def main(out: str) -> None:
    torch.set_num_threads(1)
    distributed.init(Layout(cp=2))
    rank = dist.get_rank()
    m = model()
    ids, lengths = batch()
    p = policy(m)
    got = {}
    lp, g = grads(p, ids, lengths)
    lp2, g2 = grads(p, ids, lengths)
    flat = torch.cat([x.reshape(-1) for x in g])
    got["lp"] = gather_parts(lp)  # [ranks, B, T-1]
    got["grads"] = g
    got["grads_same_on_ranks"] = bool(all(torch.equal(part, flat) for part in gather_parts(flat)))
    got["grads_same_run_to_run"] = bool(torch.equal(lp2, lp) and all(torch.equal(a, b) for a, b in zip(g2, g)))
    short = ids[:1, :20], torch.tensor([20])  # one block: rank 1 holds none of its tokens
    got["short_tokens_here"] = gather_parts(torch.tensor([ring.ZigzagShard([0, 20], 2, rank).index.shape[0]]))
    short_lp, short_grads = grads(p, *short)
    got["short_lp"], got["short_grads"] = gather_parts(short_lp), short_grads
    # A tap of layer 0's output (what an auxiliary loss reads), put back in the batch's rows on every rank.
    tapped = []
    hook = p.gpt.decoder.layers[0].register_forward_hook(lambda _m, _a, out: tapped.append(p.context.local_rows(out[0])))
    with torch.no_grad():
        p.token_logprobs(ids, lengths)
    hook.remove()
    got["layer0_rows"] = gather_parts(p.context.forward_layout.gather(tapped[0]))  # each rank's own, in row order
    mask = torch.rand(len(LENGTHS), max(LENGTHS) - 1, generator=torch.Generator().manual_seed(5)) < 0.5
    with torch.no_grad():
        got["masked_lp"] = p.token_logprobs(ids, lengths, mask=mask)

    # Negative control: the ring's partials added in ring-arrival order: other logprobs, other gradients.
    ring._ordered_sum, ordered = _arrival_order, ring._ordered_sum
    try:
        bad_lp, bad_grads = grads(p, ids, lengths)
    finally:
        ring._ordered_sum = ordered
    differs = torch.tensor([float(not torch.equal(bad_lp, lp)), float(any(not torch.equal(a, b) for a, b in zip(bad_grads, g)))])
    dist.all_reduce(differs)
    got["arrival_order_differs"] = differs.tolist()
    got["fast_refused"] = _refusal(lambda: policy(m, "fast"))
    got["window_refused"] = _refusal(lambda: MegatronPolicy(tiny_model(0, vocab_size=VOCAB, sliding_window=32).config))

    # A learner update over the 2 context-parallel ranks; then one with a co-trained draft, trained on both
    # ranks from their own tokens' features (taps.py, DraftTrainer.context_step).
    with ops.use_kernels("consistent"):
        if rank:
            MegatronLearner.follow()
        else:
            lrn = learner(m, Layout(cp=2))
            got["rl_metrics"], got["rl_lp"] = lrn.rl_step(*rl_batch())
            got["rl_grads"] = [q.grad.clone() for q in lrn.model.parameters()]
            got["rl_weights"], got["rl_mirror"] = lrn.state_dict_copy(), m.state_dict()
            lrn.stop()
    got.update(_cotrained("draft"))
    with ops.use_kernels("consistent"):  # a batch cut into two forwards: the draft's one packed row is refused
        if rank:
            MegatronLearner.follow()
        else:
            mirror = model()
            lrn = learner(mirror, Layout(cp=2, grad_shares=2))
            got["shares_refused"] = _refusal(lambda: lrn.add_aux_loss(draft(mirror)))
            lrn.stop()
    # Negative control: the same draft step without the branch attention.
    ring.draft_attention = _without_branch
    try:
        got.update(_cotrained("no_branch"))
    finally:
        ring.draft_attention = _draft_attention
    if rank == 0:
        torch.save(got, out)


if __name__ == "__main__":
    main(sys.argv[1])
