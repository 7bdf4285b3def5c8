"""Context parallelism on the Megatron learner (megatron.cp = 2, runtime/megatron/context.py): one launch of 2
ranks (tests/megatron_context_ranks.py) for every multi-rank check.

- Logprobs: a batch of sequences of different lengths (attention crossing the ranks), packed and split by the
  zigzag shard, equals cp = 1's Megatron policy and the built-in Decoder bit for bit, on both ranks; so does one
  short sequence that leaves rank 1 without tokens; the loss mask zeroes as at cp = 1.
- Gradients: the ranks' parts added in a fixed tree over the group: the same bits on both ranks and run to run;
  equal to cp = 1's within float32 rounding, not bit for bit (cp = 1 sums a weight's gradient over all tokens in
  one product, and its attention's backward is the library's; the ring's is its own, in fixed orders). A learner
  update: the loss (from the bit-equal logprobs) equals cp = 1's bit for bit, the gradients within rounding, and
  rank 0's Decoder mirror follows the step.
- Negative controls: the ring's partials merged in arrival order change logprobs and gradients; Megatron's own
  layers (fast kernels) differ from the consistent logprobs at cp = 1 and are refused at cp = 2 in one line, as
  is a sliding window (the ring is full causal attention only).
"""
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_context_ranks import LENGTHS, batch, draft, learner, loss_weights, model, policy, rl_batch  # noqa: E402
from megatron_world import launched, world_of_one  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models.decoder import packed_rows  # noqa: E402
from nemo_rz.runtime.learner import Learner  # noqa: E402
from nemo_rz.runtime.megatron.layout import Layout  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GRAD_REL = 2e-6  # cp = 2 vs cp = 1 gradients: the largest difference over each parameter's largest entry
WEIGHT_TOL = 1e-5  # the draft's weights after one Adam step of lr 1e-3 (measured: within 1e-6 of one process's)


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with world_of_one():
        yield


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launched("megatron_context_ranks.py", tmp_path_factory.mktemp("cp") / "out.pt")


def _cp1_grads(ids, lengths):
    p = policy(model())
    lp = p.token_logprobs(ids, lengths)
    (lp * loss_weights()[: ids.shape[0], : ids.shape[1] - 1]).sum().backward()
    return lp.detach(), [q.grad for q in p.parameters()]


def _close(a: torch.Tensor, b: torch.Tensor, rel: float = GRAD_REL) -> bool:
    return bool((a - b).abs().max() <= rel * b.abs().max())


@pytest.mark.slow
def test_cp2_logprobs_equal_cp1_and_the_decoder_bit_for_bit(ranks):
    ids, lengths = batch()
    want = model().token_logprobs(ids, lengths)
    cp1, _ = _cp1_grads(ids, lengths)
    assert torch.equal(cp1, want)
    assert all(torch.equal(lp, want) for lp in ranks["lp"])
    short = ids[:1, :20]
    assert ranks["short_tokens_here"].view(-1).tolist() == [20, 0]
    assert all(torch.equal(lp, model().token_logprobs(short, torch.tensor([20]))) for lp in ranks["short_lp"])
    # A tap of layer 0 (an auxiliary loss's features): on every rank the rows cp = 1's dense forward computes.
    p, out = policy(model()), []
    hook = p.gpt.decoder.layers[0].register_forward_hook(lambda _m, _a, o: out.append(o[0].detach().transpose(0, 1)))
    with torch.no_grad():
        p.token_logprobs(ids, lengths)
    hook.remove()
    dense = out[0].reshape(-1, out[0].shape[-1])[packed_rows(lengths, max(LENGTHS))]  # the packed row's tokens
    assert all(torch.equal(rows, dense) for rows in ranks["layer0_rows"])  # each rank's own rows, put in row order
    mask = torch.rand(len(LENGTHS), max(LENGTHS) - 1, generator=torch.Generator().manual_seed(5)) < 0.5
    assert torch.equal(ranks["masked_lp"], torch.where(mask, want, 0.0))
    # Negative controls: the ring's partials in arrival order; Megatron's own layers at cp = 1.
    assert ranks["arrival_order_differs"][0] > 0, "merging in ring-arrival order should change some logprobs"
    with ops.use_kernels("fast"):
        fast = policy(model(), "fast").token_logprobs(ids, lengths)
    assert not torch.equal(fast, want) and torch.allclose(fast, want, atol=1e-4)


@pytest.mark.slow
def test_cp2_gradients_are_deterministic_and_equal_cp1_within_rounding(ranks):
    assert ranks["grads_same_on_ranks"] and ranks["grads_same_run_to_run"]
    ids, lengths = batch()
    _, cp1 = _cp1_grads(ids, lengths)
    assert all(_close(a, b) for a, b in zip(ranks["grads"], cp1, strict=True))
    # Not bit for bit: each rank's weight gradients sum over its own tokens, then the ranks' parts are added.
    assert not all(torch.equal(a, b) for a, b in zip(ranks["grads"], cp1))
    _, short = _cp1_grads(ids[:1, :20], torch.tensor([20]))  # rank 1 held no token: its part is zeros
    assert all(_close(a, b) for a, b in zip(ranks["short_grads"], short, strict=True))
    assert ranks["arrival_order_differs"][1] > 0, "merging in ring-arrival order should change some gradients"


@pytest.mark.slow
def test_cp2_learner_update_matches_cp1(ranks):
    m = model()
    lrn = learner(m, Layout())
    metrics, _ = lrn.rl_step(*rl_batch())
    assert ranks["rl_metrics"]["loss"] == metrics["loss"]  # the loss of bit-equal logprobs
    grads = [q.grad for q in lrn.model.parameters()]
    assert all(_close(a, b) for a, b in zip(ranks["rl_grads"], grads, strict=True))
    # The mirror (rank 0's Decoder) followed the step: the learner's weights, whole.
    assert all(torch.equal(ranks["rl_weights"][k], v) for k, v in ranks["rl_mirror"].items())


@pytest.mark.slow
def test_what_the_ring_does_not_compute_is_refused_in_one_line(ranks):
    assert "megatron.cp = 2 with kernels=fast" in ranks["fast_refused"] and "\n" not in ranks["fast_refused"]
    assert "this model has sliding-window attention" in ranks["window_refused"]
    # A co-trained draft trains over the ranks of the batch's one forward: more forwards (grad_shares) are refused.
    assert "megatron.grad_shares = 2 cut the batch into 2 forwards" in ranks["shares_refused"]
    assert "\n" not in ranks["shares_refused"]


def _builtin_draft():
    """One RL update of the built-in learner (one process) with the co-trained draft: its draft metrics, gradients
    and weights after it. On one thread, as the ranks run: the draft's backward is the library's, whose bits follow
    the thread count."""
    mirror, threads = model(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ops.use_kernels("consistent"):
            lrn = Learner(mirror, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})
            lrn.add_aux_loss(draft(mirror))
            metrics, _ = lrn.rl_step(*rl_batch())
    finally:
        torch.set_num_threads(threads)
    grads = {n: q.grad for n, q in lrn.draft.draft.named_parameters()}
    return {k: v for k, v in metrics.items() if k.startswith("draft")}, grads, lrn.draft.shipped()


@pytest.mark.slow
def test_the_cotrained_draft_under_cp2_trains_rank_locally_as_one_process(ranks):
    """Each context-parallel rank trains its copy of the draft on its own tokens' features: the training-time
    test through the ring and rank-local branch attention (parallel.context.cp_draft_loss). Every root's loss term
    is one process's bits, so the draft's loss and metrics equal the built-in learner's bit for bit; its gradients
    are the ranks' parts added in a fixed tree (the same on both ranks), equal to one process's within float32
    rounding, not bit for bit (one process's weight gradient is one product over all roots); both ranks' weights
    after the step are the same bits, one process's within rounding."""
    metrics, grads, weights = _builtin_draft()
    assert {"draft_loss", "draft_accept_rate", "draft_tokens_per_pass"} <= metrics.keys()
    assert ranks["draft_metrics"] == metrics
    assert grads.keys() == ranks["draft_grads"].keys()
    assert all(_close(ranks["draft_grads"][n], g) for n, g in grads.items())
    assert not all(torch.equal(ranks["draft_grads"][n], g) for n, g in grads.items())
    mine, copy = ranks["draft_weights"]
    assert mine.keys() == copy.keys() == weights.keys() and all(torch.equal(mine[k], copy[k]) for k in mine)
    assert all((mine[k].float() - v.float()).abs().max() <= WEIGHT_TOL for k, v in weights.items())
    # Negative control: steps 2 and 3 without their rank-local branch (each attending to its own step's entries
    # over the ring): the loss leaves rounding distance, and so do the gradients.
    bad = ranks["no_branch_metrics"]
    assert bad.keys() == metrics.keys() and abs(bad["draft_loss"] - metrics["draft_loss"]) > 1e-4 * metrics["draft_loss"]
    assert not all(_close(ranks["no_branch_grads"][n], g) for n, g in grads.items())
