"""Sliding-window layers keep only what the window needs: with a prefill chunk, the built-in engine gives each
window layer a ring of window - 1 + chunk positions (rounded up to a key block) instead of the full length, and
every token's logprob is still the learner's bit for bit: decode, chunked prefill, prompts many windows long,
prefix-cache hits (from the blocks the ring still held), speculative-free and batched. Negative controls: a ring
one block too short for the chunk loses keys the window still sees, and fast kernels differ.
"""
import pytest
import torch
from conftest import count_diff
from test_families import WINDOW, _engine_model

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams

PARAMS = SamplingParams(max_new_tokens=10, seed=3)


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 12 * WINDOW) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi, (n,), generator=g)]


@pytest.mark.parametrize("kind", ["gpt-oss-like", "gemma-like"])
def test_window_layers_keep_a_ring_and_the_learners_bits(kind):
    model = _engine_model(kind)
    engine = RolloutEngine(model, max_batch_size=16, max_model_len=256, prefill_chunk=5)
    outs = engine.generate(_prompts(16, seed=1), PARAMS)
    slots = [k.shape[2] for k in engine._cache.k]
    assert slots == [32, 256, 32]  # window 8 - 1 + chunk 5 = 12 -> one 32-key block; the full layer keeps 256
    assert count_diff(model, outs) == (0, 16 * 10)
    # Prefix-cache hits: a shared prefix of 6 windows, then tails; the ring held the blocks the tails still see.
    base = _prompts(1, seed=2, lo=48, hi=49)[0]
    prompts = [base + tail for tail in _prompts(6, seed=3, lo=1, hi=2 * WINDOW)]
    first = engine.generate(prompts[:1], PARAMS)
    hits = engine.stats["prefix_hit_tokens"]
    rest = engine.generate(prompts, PARAMS)
    assert engine.stats["prefix_hit_tokens"] > hits
    assert count_diff(model, first + rest) == (0, 7 * 10)
    assert rest[0].token_ids == first[0].token_ids and torch.equal(rest[0].logprobs, first[0].logprobs)


def test_without_a_prefill_chunk_every_layer_keeps_the_full_length():
    model = _engine_model("gpt-oss-like")
    engine = RolloutEngine(model, max_batch_size=4, max_model_len=256)
    engine.generate(_prompts(2, seed=4), PARAMS)
    assert [k.shape[2] for k in engine._cache.k] == [256, 256, 256]


def test_a_ring_too_short_for_the_chunk_loses_keys_the_window_sees():
    """Negative control: the same engine with rings of one key block for a chunk of 32 (window 8 needs 39
    slots): prefill overwrites keys that earlier queries of the same chunk still see."""
    model = _engine_model("gpt-oss-like")
    engine = RolloutEngine(model, max_batch_size=8, max_model_len=256, prefill_chunk=32)
    real = model.new_cache
    model.new_cache = lambda n, length, device=None, step_tokens=None: real(n, length, device, step_tokens=1)
    try:
        outs = engine.generate(_prompts(8, seed=5, lo=40), PARAMS)
    finally:
        model.new_cache = real
    assert [k.shape[2] for k in engine._cache.k] == [32, 256, 32]
    assert count_diff(model, outs)[0] > 0


def test_fast_kernels_differ_with_rings():
    model = _engine_model("gemma-like")
    with ops.use_kernels("fast"):
        engine = RolloutEngine(model, max_batch_size=16, max_model_len=256, prefill_chunk=5)
        outs = engine.generate(_prompts(16, seed=6), PARAMS)
    assert [k.shape[2] for k in engine._cache.k] == [32, 256, 32]
    assert count_diff(model, outs)[0] > 0
