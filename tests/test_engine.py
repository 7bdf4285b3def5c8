"""Rollout engine behaviour: seeds, continuous batching, stopping, weight updates, clear errors."""
import pytest
import torch
from conftest import count_diff, tiny_model

from nemo_rz.generation import RolloutEngine, SamplingParams

MODEL = tiny_model(seed=1)
PROMPTS = [[3, 4, 5], [7] * 20, [1, 2], [9, 8, 7, 6, 5, 4, 3]]


def test_seeded_requests_reproduce_and_differ_by_seed():
    engine = RolloutEngine(MODEL, max_batch_size=2)
    a = engine.generate(PROMPTS, SamplingParams(12, seed=5))
    b = RolloutEngine(MODEL, max_batch_size=4).generate(PROMPTS, SamplingParams(12, seed=5))
    c = engine.generate(PROMPTS, SamplingParams(12, seed=6))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_unseeded_requests_differ_from_each_other_but_runs_repeat():
    run1 = RolloutEngine(MODEL, seed=3).generate([PROMPTS[0]] * 8, SamplingParams(10))
    run2 = RolloutEngine(MODEL, seed=3).generate([PROMPTS[0]] * 8, SamplingParams(10))
    assert len({tuple(c.token_ids) for c in run1}) > 1
    assert [c.token_ids for c in run1] == [c.token_ids for c in run2]


def test_continuous_batching_joins_and_stops():
    engine = RolloutEngine(MODEL, max_batch_size=3)
    params = [SamplingParams(max_new_tokens=n, seed=n) for n in (2, 30, 5, 11, 1, 7, 3)]
    outs = engine.generate([PROMPTS[i % 4] for i in range(7)], params)
    assert [len(c.token_ids) for c in outs] == [2, 30, 5, 11, 1, 7, 3]
    assert all(c.finish_reason == "length" for c in outs)
    assert engine.stats["steps"] < sum(len(c.token_ids) for c in outs)  # several requests share each step
    assert count_diff(MODEL, outs)[0] == 0


def test_stop_tokens_end_a_request_and_are_kept():
    greedy = RolloutEngine(MODEL).generate([PROMPTS[1]], SamplingParams(20, temperature=0.0))[0]
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)
    out = RolloutEngine(MODEL).generate([PROMPTS[1]], SamplingParams(20, temperature=0.0, stop_token_ids=(stop,)))[0]
    assert out.token_ids == greedy.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == (first + 1,)


def test_update_weights_changes_outputs_version_and_drops_prefix_cache():
    model = tiny_model(seed=2)
    engine = RolloutEngine(model)
    before = engine.generate([PROMPTS[1]], SamplingParams(8, seed=0))[0]
    assert before.weight_version == 0 and len(engine.prefix_cache) > 0
    engine.update_weights(tiny_model(seed=3).state_dict(), version=7)
    assert len(engine.prefix_cache) == 0
    after = engine.generate([PROMPTS[1]], SamplingParams(8, seed=0))[0]
    assert after.weight_version == 7 and not torch.equal(after.logprobs, before.logprobs)
    assert count_diff(model, [after])[0] == 0


@pytest.mark.parametrize(
    "prompts, params, message",
    [
        ([[]], SamplingParams(4), "prompt 0 is empty"),
        ([[1, 999]], SamplingParams(4), "token id 999 outside"),
        ([[1] * 10], SamplingParams(2000), "exceeds max_model_len"),
        ([[1], [2]], [SamplingParams(4)], "2 prompts but 1 SamplingParams"),
    ],
)
def test_bad_requests_get_clear_errors(prompts, params, message):
    with pytest.raises(ValueError, match=message):
        RolloutEngine(MODEL).generate(prompts, params)


@pytest.mark.parametrize("kwargs, message", [(dict(max_new_tokens=0), "max_new_tokens"),
                                             (dict(max_new_tokens=3, temperature=-1.0), "temperature")])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("variant", [{}, dict(sliding_window=6, layer_types=["sliding_attention", "full_attention"])])
def test_a_group_sharing_a_prompt_computes_it_once_with_the_same_bits(variant, monkeypatch):
    """8 samples of each of 3 prompts admitted together: each prompt's tokens run once (the twins start from a copy
    of its keys/values and compute only its last token), and every logprob is what each request computes alone."""
    model = tiny_model(seed=2, **variant)
    prompts = [p for p in ([3, 4, 5, 6, 7, 8, 9, 10, 11], [7] * 20, [1, 2]) for _ in range(8)]
    params = [SamplingParams(6, temperature=0.9, seed=i) for i in range(len(prompts))]
    engine = RolloutEngine(model, max_batch_size=32, prefill_chunk=8)
    outs = engine.generate(prompts, params)
    assert engine.stats["prefill_tokens"] == (9 + 20 + 2) + 7 * 3  # each prompt once, then one token per twin
    alone = [RolloutEngine(model, prefix_cache_blocks=0).generate([p], [q])[0] for p, q in zip(prompts, params)]
    assert [c.token_ids for c in outs] == [c.token_ids for c in alone]
    assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(outs, alone))
    assert count_diff(model, outs, 0.9) == (0, sum(len(c.token_ids) for c in outs))
    # negative control: twins started from another prompt's keys/values
    copy = RolloutEngine._copy_slot
    monkeypatch.setattr(RolloutEngine, "_copy_slot", lambda self, src, dst: copy(self, (src + 1) % 32, dst))
    wrong = RolloutEngine(model, max_batch_size=32, prefill_chunk=8).generate(prompts, params)
    assert any(not torch.equal(a.logprobs, b.logprobs) for a, b in zip(wrong, alone))
