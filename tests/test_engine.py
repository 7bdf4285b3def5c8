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
