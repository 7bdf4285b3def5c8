"""Zero mismatch (docs/contracts.md, 1): the engine's recorded logprobs equal the learner's, bit for bit, in
consistent mode.

Every test runs the same scenario in fast mode as its negative control: there the library kernels must
produce differences, proving the comparison can fail.
"""
import pytest
import torch
from conftest import count_diff, tiny_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams

MODEL = tiny_model()


def _prompts(seed: int, n: int, max_len: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    return [torch.randint(0, MODEL.config.vocab_size, (int(k),), generator=g).tolist() for k in lengths]


def _run(prompts, max_batch_size=64, prefill_chunk=None, max_new_tokens=12, temperature=1.0, seed=0, stop=()):
    engine = RolloutEngine(MODEL, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stop_token_ids=stop)
    return engine, engine.generate(prompts, params)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 64),
    max_batch=st.sampled_from([1, 3, 8, 64]),
    max_len=st.integers(1, 40),
    chunk=st.sampled_from([None, 1, 5, 32]),
    seed=st.integers(0, 2**16),
)
def test_engine_matches_learner_any_batch(n, max_batch, max_len, chunk, seed):
    # Stop tokens make requests finish at different lengths, so queued requests join mid-flight.
    _, outs = _run(_prompts(seed, n, max_len), max_batch_size=max_batch, prefill_chunk=chunk, seed=seed, stop=(0, 1, 2))
    diff, total = count_diff(MODEL, outs)
    assert total > 0 and diff == 0


def test_fast_mode_finds_differences():
    prompts = _prompts(7, 48, 30)
    with ops.use_kernels("fast"):
        _, outs = _run(prompts, max_batch_size=16, prefill_chunk=8)
        diff, total = count_diff(MODEL, outs)
    assert diff > 0, "negative control: library kernels should differ between rollout and learner"
    _, outs = _run(prompts, max_batch_size=16, prefill_chunk=8)
    assert count_diff(MODEL, outs)[0] == 0


def test_position_and_batch_composition_do_not_change_a_request():
    target = _prompts(1, 1, 20)[0]
    params = SamplingParams(max_new_tokens=16, seed=99)
    alone = RolloutEngine(MODEL, max_batch_size=1).generate([target], params)[0]
    others = _prompts(2, 30, 35)
    crowd = RolloutEngine(MODEL, max_batch_size=8).generate(
        others[:17] + [target] + others[17:],
        [SamplingParams(16, seed=i) for i in range(17)] + [params] + [SamplingParams(16, seed=i) for i in range(18, 31)])[17]
    assert crowd.token_ids == alone.token_ids
    assert torch.equal(crowd.logprobs, alone.logprobs)


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6, 0.0])
def test_temperature_is_applied_identically(temperature):
    _, outs = _run(_prompts(3, 20, 12), temperature=temperature)
    learner_t = temperature or 1.0  # greedy records logprobs at temperature 1
    assert count_diff(MODEL, outs, learner_t) == (0, sum(len(c.token_ids) for c in outs))


def test_prefix_cache_hit_equals_miss():
    shared = _prompts(4, 1, 1)[0] * 0 + torch.randint(0, 48, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [shared + tail for tail in _prompts(6, 12, 6)]
    params = SamplingParams(max_new_tokens=10, seed=11)
    cold = RolloutEngine(MODEL, max_batch_size=4, prefix_cache_blocks=0).generate(prompts, params)
    warm_engine = RolloutEngine(MODEL, max_batch_size=4)
    warm_engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))
    warm = warm_engine.generate(prompts, params)
    assert warm_engine.stats["prefix_hit_tokens"] >= 12 * 32, warm_engine.stats
    for a, b in zip(cold, warm):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    assert count_diff(MODEL, warm)[0] == 0


def test_prefix_cache_hit_differs_in_fast_mode():
    """Negative control for the cache test: with library kernels, logprobs after a hit differ from the learner's."""
    prompts = [torch.randint(0, 48, (48,), generator=torch.Generator().manual_seed(5)).tolist()] * 8
    with ops.use_kernels("fast"):
        engine = RolloutEngine(MODEL)
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=1, seed=0))
        warm = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=1))
        assert engine.stats["prefix_hit_tokens"] > 0
        assert count_diff(MODEL, warm)[0] > 0


def test_bf16_model_matches_its_learner():
    model = tiny_model(dtype="bfloat16")
    outs = RolloutEngine(model, max_batch_size=8).generate(_prompts(8, 20, 15), SamplingParams(10, seed=4))
    assert count_diff(model, outs)[0] == 0


def test_sliding_window_model_matches_its_learner():
    model = tiny_model(sliding_window=8)
    outs = RolloutEngine(model, max_batch_size=5, prefill_chunk=7).generate(_prompts(9, 16, 30), SamplingParams(12, seed=4))
    assert count_diff(model, outs)[0] == 0
