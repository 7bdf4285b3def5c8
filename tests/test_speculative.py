"""Speculative rollouts in the built-in engine: the recorded logprobs are the target's, bit for bit the learner's;
greedy tokens are plain greedy decoding's; sampled tokens follow the target's distribution."""
import random

import pytest
import torch
from conftest import count_diff, tiny_model

from nemo_rz import ops
from nemo_rz.algorithms.draft import DraftTrainer
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.generation.speculative import Speculator
from nemo_rz.models.draft import DraftHead, aux_features

MODEL = tiny_model(seed=1)
RNG = random.Random(0)
SHARED = [RNG.randrange(48) for _ in range(40)]
# Mixed lengths; most share a prefix of one or two 16-token blocks, so later requests hit the prefix cache.
PROMPTS = [SHARED[: RNG.randrange(17, 40)] + [RNG.randrange(48) for _ in range(RNG.randrange(1, 4))] for _ in range(6)]
PROMPTS += [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module", params=[None, 12], ids=["full-vocab", "vocab-12"])
def draft(request):
    """A draft co-trained a little on the target's own greedy and sampled completions (so some proposals are
    accepted and some refused); with the whole vocabulary, or with 12 tokens chosen from the completions (the
    target then emits tokens the draft cannot propose)."""
    torch.manual_seed(0)
    head = DraftHead(MODEL.config, num_layers=1, vocab_size=request.param)
    trainer = DraftTrainer(head, "cotrain", 8e-3, 1.0, steps=3, k=4)
    outs = RolloutEngine(MODEL).generate(PROMPTS, SamplingParams(12, temperature=0.0))
    outs += RolloutEngine(MODEL).generate(PROMPTS, SamplingParams(12, temperature=1.0, seed=1))
    batch = pack(outs)
    with aux_features(MODEL, head.aux_layers) as found, torch.no_grad():
        MODEL.token_logprobs(batch.input_ids)  # the padded layout trainer.step reads
    for _ in range(12):
        trainer.step(MODEL, found[0], batch.input_ids, batch.mask, 1.0)
    return head


def _speculative(draft, k=4, **kw):
    return RolloutEngine(MODEL, speculator=Speculator(draft, k), **kw)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_the_learners_and_greedy_tokens_equal_plain_decoding(draft, temperature):
    params = SamplingParams(12, temperature=temperature, seed=3)
    plain = RolloutEngine(MODEL, max_batch_size=3).generate(PROMPTS, params)
    engine = _speculative(draft, max_batch_size=3, prefill_chunk=8)  # continuous batching, chunked prefill
    spec = engine.generate(PROMPTS, params)
    again = engine.generate(PROMPTS, params)  # now with prefix-cache hits for every shared block
    stats = engine.stats
    assert stats["prefix_hit_tokens"] > 0
    assert 0 < stats["spec_accepted"] < stats["spec_proposed"]  # both paths of the verifier ran
    for out in (spec, again):
        assert count_diff(MODEL, out, temperature or 1.0) == (0, sum(len(c.token_ids) for c in out))
    assert [c.token_ids for c in again] == [c.token_ids for c in spec]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(again, spec))
    if temperature == 0:
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
        assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(spec, plain))
    if temperature == 0:
        return
    # Negative control: the same speculative rollout on the library kernels differs from the learner's bits.
    with ops.use_kernels("fast"):
        fast = _speculative(draft, max_batch_size=3, prefill_chunk=8).generate(PROMPTS, params)
    assert count_diff(MODEL, fast, temperature or 1.0)[0] > 0


def test_a_perturbed_verify_pass_is_caught(draft, monkeypatch):
    """Negative control at the verify pass itself: scoring the k + 1 rows with the library log-softmax (the
    engine scores every step's rows, the verified ones among them)."""
    import nemo_rz.generation.engine as engine_mod

    class Perturbed:
        def __getattr__(self, name):
            return getattr(ops, name)

        @staticmethod
        def log_softmax(logits, temperature=1.0):
            return torch.log_softmax(logits.float() / temperature, -1)

    monkeypatch.setattr(engine_mod, "ops", Perturbed())
    out = _speculative(draft).generate(PROMPTS, SamplingParams(16, temperature=1.0, seed=3))
    assert count_diff(MODEL, out)[0] > 0


def test_rows_do_not_depend_on_the_batch_or_k(draft):
    """A greedy request emits the same tokens and logprobs alone, in a batch, and with any k."""
    params = SamplingParams(12, temperature=0.0)
    alone = [_speculative(draft, k=1).generate([p], params)[0] for p in PROMPTS[:4]]
    for k in (2, 5):
        batched = _speculative(draft, k=k, max_batch_size=8).generate(PROMPTS[:4], params)
        assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
        assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(batched, alone))


def _joint_counts(engine, prompt, n, vocab):
    """Counts of each (t1, t2, t3) over n sampled completions of `prompt`."""
    outs = engine.generate([prompt] * n, SamplingParams(3, temperature=1.0, seed=11))
    counts = torch.zeros(vocab ** 3)
    for c in outs:
        a, b, d = c.token_ids
        counts[(a * vocab + b) * vocab + d] += 1
    return counts


def _target_joint(model, prompt, vocab):
    """p(t1, t2, t3 | prompt) of the target, from the learner path, in float64."""
    with torch.no_grad():
        grid = torch.cartesian_prod(*[torch.arange(vocab)] * 3)
        ids = torch.cat([torch.tensor(prompt).expand(len(grid), -1), grid], 1)
        lp = model.token_logprobs(ids)[:, len(prompt) - 1 :].double().sum(1)
    return lp.exp()


@pytest.mark.parametrize("draft_vocab", [None, 2])
def test_sampled_tokens_follow_the_target_distribution(draft_vocab):
    """Chi-square over the joint of 3 tokens (2 of them speculative) on a 4-token vocabulary, with a draft over
    all 4 tokens or over 2 of them (q = 0 for the others); a verifier that accepts every draft token (negative
    control) follows the draft instead and fails the same test."""
    vocab, prompt, n = 4, [1, 2, 3], 2000
    target = tiny_model(seed=4, vocab_size=vocab)
    torch.manual_seed(5)
    head = DraftHead(target.config, vocab_size=draft_vocab)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)  # a confident draft that disagrees with the target
    expected = _target_joint(target, prompt, vocab)
    assert abs(float(expected.sum()) - 1) < 1e-5

    def chi2_p(counts):
        keep = expected * n >= 5  # cells too small for the test are pooled into one
        obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([expected[keep], expected[~keep].sum(0, keepdim=True)]) * n
        exp = exp.double() * obs.sum().item() / exp.sum().item()
        stat = ((obs.double() - exp) ** 2 / exp).sum()
        dof = torch.tensor(float(len(obs) - 1), dtype=torch.float64)
        return torch.special.gammaincc(dof / 2, stat / 2).item()  # the chi-square survival function

    engine = RolloutEngine(target, max_batch_size=64, speculator=Speculator(head, 2))
    counts = _joint_counts(engine, prompt, n, vocab)
    assert engine.stats["spec_accepted"] < engine.stats["spec_proposed"]  # refusals and residual draws happen
    assert chi2_p(counts) > 1e-3

    class AcceptAll(Speculator):
        def admit(self, req, cached):
            cached = super().admit(req, cached)
            req.policy_state.accept_u = [0.0] * req.params.max_new_tokens
            return cached

    n = 600
    broken = _joint_counts(RolloutEngine(target, max_batch_size=64, speculator=AcceptAll(head, 2)), prompt, n, vocab)
    assert chi2_p(broken) < 1e-6


def test_bad_settings_are_one_line_errors(draft):
    with pytest.raises(ValueError, match=r"draft.k = 0: must be >= 1"):
        Speculator(draft, 0)
    other = tiny_model(seed=1, vocab_size=40)
    with pytest.raises(ValueError, match="draft vocab_size 48 does not match the target's 40"):
        RolloutEngine(other, speculator=Speculator(draft, 2))
    wide = tiny_model(seed=1, hidden_size=32)
    with pytest.raises(ValueError, match="draft hidden_size 64 does not match the target's 32"):
        RolloutEngine(wide, speculator=Speculator(draft, 2))


def test_moe_rollouts_record_the_experts_of_every_emitted_token():
    """A speculative step emits several tokens from one target pass; each gets the experts of the row that
    scored it, the routing plain decoding records (greedy: the same tokens, so the same rows)."""
    from test_families import _engine_model

    model = _engine_model("qwen3-moe-like")
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12]]
    params = SamplingParams(10, temperature=0.0)
    plain = RolloutEngine(model, max_batch_size=2, max_model_len=64).generate(prompts, params)
    torch.manual_seed(0)
    spec = RolloutEngine(model, max_batch_size=2, max_model_len=64, speculator=Speculator(DraftHead(model.config), 3))
    out = spec.generate(prompts, params)
    assert spec.stats["spec_verify"] > 0
    assert [c.token_ids for c in out] == [c.token_ids for c in plain]
    assert all(c.routing is not None and torch.equal(c.routing, p.routing) for c, p in zip(out, plain))
