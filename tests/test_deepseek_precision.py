"""Precision recipes on the DeepSeek-V3 family: multi-head latent attention's projections (q_a / q_b, kv_a, kv_b,
o) and the routed and shared experts run quantized; the router (with its selection bias) and the latent norms stay
in high precision. The absorbed attention splits W_UK / W_UV from Q(kv_b_proj) (dequantize, then absorb).

- Zero mismatch: under a recipe, the built-in engine's recorded logprobs equal the learner's, bit for bit (float32
  and bfloat16 models, mixed batches, chunked prefill against the latent cache).
- Negative controls: the quantized model's logits differ from the unquantized one's, and with kv_b_proj alone put
  back in high precision they differ again (its quantization reaches the absorbed products).
"""
from __future__ import annotations

import pytest
import torch
from conftest import count_diff

from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.layers import Linear, RMSNorm
from nemo_rz.models.moe import DeepseekRouter
from nemo_rz.quant.apply import apply_precision
from nemo_rz.quant.experts import QuantizedExperts
from nemo_rz.quant.linear import QuantizedLinear, quantize_weight

LATENT = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def _model(dtype: str = "float32", seed: int = 0) -> Decoder:
    """A tiny DeepSeek-V3-shaped model (every input width a multiple of 32, as the block recipes need)."""
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=48, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_layers=2,
                        num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=False, attention_kind="mla", q_lora_rank=32,
                        kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True, num_experts=8,
                        num_experts_per_tok=2, moe_kind="deepseek", n_group=2, topk_group=1, n_shared_experts=1,
                        routed_scaling_factor=2.5, moe_layers=[1], dtype=dtype)
    model = Decoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model.eval()


def _quantized(recipe: str, dtype: str = "float32", modules: str = "all") -> Decoder:
    return apply_precision(_model(dtype), {"recipe": recipe, "modules": modules})


def _ids() -> torch.Tensor:
    return torch.randint(0, 48, (3, 21), generator=torch.Generator().manual_seed(1))


def test_the_recipe_covers_the_latent_projections_and_experts_not_the_router_or_norms():
    model = _quantized("fp8_block")
    for layer in model.model.layers:
        attn = layer.self_attn
        assert all(isinstance(getattr(attn, name), QuantizedLinear) for name in LATENT)
        assert type(attn.q_a_layernorm) is RMSNorm and type(attn.kv_a_layernorm) is RMSNorm
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, QuantizedExperts) and type(moe.gate) is DeepseekRouter
    assert all(isinstance(getattr(moe.shared_experts, n), QuantizedLinear) for n in ("gate_proj", "up_proj", "down_proj"))
    assert type(model.lm_head) is Linear
    experts_only = _quantized("fp8_block", modules="experts")
    assert isinstance(experts_only.model.layers[1].mlp.shared_experts.down_proj, QuantizedLinear)
    assert type(experts_only.model.layers[1].self_attn.kv_b_proj) is Linear
    assert type(experts_only.model.layers[0].mlp.down_proj) is Linear  # the dense layer's MLP is "mlp"


def test_absorbed_weights_are_split_from_the_dequantized_kv_b_proj():
    model = _quantized("nvfp4")
    attn = model.model.layers[0].self_attn
    cfg = model.config
    w = attn.kv_b_proj.weight
    values = quantize_weight(w, "nvfp4").dequantize().view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim,
                                                           cfg.kv_lora_rank)
    plain = w.detach().view_as(values)
    with torch.no_grad():
        uk, uv = attn.absorbed()
        assert uk.dtype == torch.float32 and torch.equal(uk, values[:, : cfg.qk_nope_head_dim])
        assert torch.equal(uv, values[:, cfg.qk_nope_head_dim :].transpose(1, 2))
        assert not torch.equal(uk, plain[:, : cfg.qk_nope_head_dim])  # the control: rounding changed them
        assert attn.absorbed()[0] is uk  # once per weight version
        grad_uk = None
        with torch.enable_grad():
            grad_uk = attn.absorbed()[0]
        assert torch.equal(grad_uk, uk)  # the learner's (autograd) path absorbs the same values
        w.mul_(1.5)
        assert not torch.equal(attn.absorbed()[0], uk)  # a new version: absorbed again
    # the learner's gradient goes straight through Q(kv_b_proj) to its master weight
    model.token_logprobs(_ids()).sum().backward()
    assert w.grad is not None and bool(torch.isfinite(w.grad).all()) and w.grad.abs().sum() > 0


def test_the_projections_are_quantized_negative_controls():
    ids = _ids()
    with torch.no_grad():
        plain = _model().token_logprobs(ids)
        quant_model = _quantized("nvfp4")
        quant = quant_model.token_logprobs(ids)
        attn = quant_model.model.layers[0].self_attn
        attn.kv_b_proj = Linear(32, 4 * 32, False, torch.float32)  # kv_b_proj alone back in high precision
        with torch.no_grad():
            attn.kv_b_proj.weight.copy_(_model().model.layers[0].self_attn.kv_b_proj.weight)
        kv_b_plain = quant_model.token_logprobs(ids)
    assert (plain - quant).abs().max() > 1e-3
    assert (kv_b_plain - quant).abs().max() > 1e-4


@pytest.mark.parametrize("recipe, dtype", [("fp8_block", "float32"), ("nvfp4", "bfloat16")])
def test_engine_matches_learner_under_the_recipe(recipe, dtype):
    model = _quantized(recipe, dtype)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 48, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (7,), generator=g)]
    engine = RolloutEngine(model, max_batch_size=4, prefill_chunk=5)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=4, stop_token_ids=(0,)))
    diff, total = count_diff(model, outs)
    assert total > 0 and diff == 0
