"""The DeepSeek-V3 family (DeepseekV3ForCausalLM, Kimi K2's kimi_k2 configs): multi-head latent attention and
DeepSeek routing.

- Parity: random tiny checkpoints built with transformers' own DeepseekV3Config (q_lora_rank null and set,
  YaRN with mscale / mscale_all_dim, interleaved and plain RoPE, first_k_dense_replace, n_group > 1) load with
  logits within 1e-4 of transformers in float32, save back in a form transformers loads, round-trip exactly.
  Negative controls: the wrong RoPE layout, softmax scale or selection bias gives a visible difference.
- Routing: group-limited top-k against a brute-force reading of the rule, with its tie rule (lower group, then
  lower expert index); the renormalisation sums in expert-index order.
- Zero mismatch on the built-in engine (latent KV cache): 0 differing tokens vs the learner at batch 1..64,
  chunked prefill, prefix-cache hits; every token's experts equal in rollout and learner with near-tied
  routers; fast kernels differ (the negative control).
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import assert_saved_reloads, count_diff, hf_logits, learner_routing, logit_diff, preset_run, rollout_routing
from safetensors import safe_open

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig, load_hf, save_hf
from nemo_rz.models.mla import cache_elements_per_token

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256)
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=0.7)
VARIANTS = {
    "q-proj": {},
    "q-lora": dict(q_lora_rank=24, attention_bias=True),
    "q-lora-yarn": dict(q_lora_rank=24, rope_parameters=YARN),
    "plain-rope-4-groups": dict(rope_interleave=False, n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=False,
                                n_shared_experts=2, first_k_dense_replace=2),
}


@functools.cache
def randomized(model, g: torch.Generator) -> None:
    """Non-trivial values everywhere in a transformers DeepSeek-V3 model, the selection bias included."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith("bias") else 0.15
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _hf_dir(variant: str, root) -> str:
    cfg = transformers.DeepseekV3Config(**{**BASE, **VARIANTS[variant]})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    randomized(model, torch.Generator().manual_seed(0))
    path = root / variant
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("deepseek")


def _ids(batch: int = 3, length: int = 29) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


# -- parity with transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_and_round_trips(variant, hf_root, tmp_path):
    path = _hf_dir(variant, hf_root)
    ids = _ids()
    expected = hf_logits(path, ids)
    model = load_hf(path)
    cfg = model.config
    assert cfg.attention_kind == "mla" and cfg.moe_kind == "deepseek" and cfg.num_kv_heads == 1
    assert cfg.moe_layers == list(range(VARIANTS[variant].get("first_k_dense_replace", 1), 3))
    assert logit_diff(model, ids, expected) < TOL
    assert logit_diff(model, ids, expected, "fast") < TOL
    save_hf(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["DeepseekV3ForCausalLM"]
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:  # per-expert tensors, as on the hub
        names = set(f.keys())
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in names and "model.layers.2.mlp.gate.e_score_correction_bias" in names
    assert_saved_reloads(model, tmp_path / "saved", ids, expected, TOL)


def test_kimi_k2_configs_and_mtp_layers_load(hf_root, tmp_path):
    """model_type kimi_k2 (with or without `architectures`) is this architecture; a checkpoint's MTP layer
    (model.layers.{num_hidden_layers}) is skipped, as transformers skips it."""
    from safetensors.torch import load_file, save_file

    src = _hf_dir("q-lora", hf_root)
    d = json.loads(open(f"{src}/config.json").read())
    d.pop("architectures")
    d.update(model_type="kimi_k2", num_nextn_predict_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(d))
    tensors = load_file(f"{src}/model.safetensors")
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items() if k.startswith("model.layers.2.")}
    tensors.update(mtp)
    save_file(tensors, tmp_path / "model.safetensors")
    ids = _ids()
    assert logit_diff(load_hf(tmp_path), ids, hf_logits(src, ids)) < TOL


def test_fp8_block_scaled_checkpoints_decode_exactly(hf_root, tmp_path):
    """An FP8 release's layout (E4M3 codes, 128x128 `weight_scale_inv` tiles) on every projection, the per-expert
    and shared experts included, loads as the float checkpoint of the decoded values, bit for bit."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_quantized_checkpoints import _fp8_tiles

    src = _hf_dir("q-lora", hf_root)
    tensors = load_file(f"{src}/model.safetensors")
    quantized, decoded = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith("proj.weight") or n.endswith("proj_with_mqa.weight")]:
        codes, scale_inv, decoded[name] = _fp8_tiles(tensors[name])
        quantized[name], quantized[name + "_scale_inv"] = codes, scale_inv
    for d, content in (("fp8", quantized), ("decoded", decoded)):
        (tmp_path / d).mkdir()
        shutil.copy(f"{src}/config.json", tmp_path / d / "config.json")
        save_file(content, str(tmp_path / d / "model.safetensors"))
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    mine, theirs = load_hf(tmp_path / "fp8").state_dict(), load_hf(tmp_path / "decoded").state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert not torch.equal(theirs["model.layers.1.self_attn.kv_b_proj.weight"],
                           load_hf(src).state_dict()["model.layers.1.self_attn.kv_b_proj.weight"])  # FP8 rounded them


@pytest.mark.parametrize("breakage", ["rope_interleave", "attention_scale", "selection_bias"])
def test_negative_controls_the_parity_bound_can_fail(breakage, hf_root, monkeypatch):
    path = _hf_dir("q-lora-yarn", hf_root)
    ids = _ids()
    expected = hf_logits(path, ids)
    model = load_hf(path)
    if breakage == "rope_interleave":
        model.config.rope_interleave = False
    elif breakage == "attention_scale":
        monkeypatch.setattr(DecoderConfig, "attention_scale", property(lambda c: (c.qk_nope_head_dim + c.head_dim) ** -0.5))
    else:
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.zero_()
    assert logit_diff(model, ids, expected) > 10 * TOL


# -- routing ------------------------------------------------------------------------------------------------
def _brute_force(choice: torch.Tensor, k: int, n_group: int, topk_group: int) -> list[list[int]]:
    """The rule read literally, one row at a time, in Python: groups by (top-2 sum desc, index asc), then
    experts by (choice desc, index asc)."""
    out = []
    per = choice.shape[1] // n_group
    for row in choice.tolist():
        score = [sum(sorted(row[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: (-score[g], g))[:topk_group]
        experts = [e for g in sorted(groups) for e in range(g * per, (g + 1) * per)]
        out.append(sorted(experts, key=lambda e: (-row[e], e))[:k])
    return out


def test_grouped_top_k_and_its_tie_rule():
    g = torch.Generator().manual_seed(0)
    # values on a coarse grid: many ties between experts and between groups
    choice = torch.randint(0, 4, (200, 12), generator=g).float() / 4
    for n_group, topk_group, k in ((3, 2, 3), (4, 1, 2), (2, 2, 5), (6, 3, 2)):
        got = ops.route_grouped_topk(choice, k, n_group, topk_group).tolist()
        assert got == _brute_force(choice, k, n_group, topk_group)
    # the row's experts do not depend on the other rows
    assert ops.route_grouped_topk(choice[7:8], 3, 3, 2).tolist() == [_brute_force(choice[7:8], 3, 3, 2)[0]]
    with pytest.raises(ValueError, match="NaN or inf"):
        ops.route_grouped_topk(torch.full((1, 4), float("nan")), 1, 2, 1)


def test_sigmoid_rows_do_not_depend_on_the_batch():
    """ops.sigmoid (router scores; Qwen2-MoE's one-wide shared-expert gate): a row's bits are the same alone, in any
    slice, at any width, and within float32 rounding of torch.sigmoid."""
    g = torch.Generator().manual_seed(0)
    for width in (1, 3, 8, 16, 20):
        z = torch.randn(37, width, generator=g)
        full = ops.sigmoid(z)
        assert all(torch.equal(ops.sigmoid(z[i:i + n]), full[i:i + n]) for n in (1, 5, 9) for i in range(0, 37 - n))
        assert (full - torch.sigmoid(z)).abs().max() < 1e-6


# -- zero mismatch on the built-in engine -------------------------------------------------------------------
def _engine_model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=48, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_layers=3, num_heads=4,
               num_kv_heads=1, head_dim=16, qk_norm=False, attention_kind="mla", q_lora_rank=24, kv_lora_rank=32,
               qk_nope_head_dim=16, v_head_dim=24, rope_interleave=True, num_experts=8, num_experts_per_tok=2,
               moe_kind="deepseek", n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, moe_layers=[1, 2],
               rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0))
    model = Decoder(DecoderConfig(**{**cfg, **overrides}))
    with torch.no_grad():  # peaky, varied distributions (as conftest.tiny_model)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


def _prompts(seed: int, n: int, max_len: int, min_len: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in lengths]


def _generate(model, prompts, max_batch_size, prefill_chunk, engine=None):
    engine = engine or RolloutEngine(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk)
    return engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=4, stop_token_ids=(0, 1)))


def test_the_cache_holds_the_latent():
    model = _engine_model()
    cache = model.new_cache(3, 40)
    assert all(k is v and tuple(k.shape) == (3, 1, cache.max_len, 32 + 16) for k, v in zip(cache.k, cache.v))
    latent, per_head = cache_elements_per_token(model.config)
    assert (latent, per_head) == (48, 4 * (16 + 16 + 24))


@pytest.mark.parametrize("max_batch, chunk", [(1, None), (7, 5), (64, 3)])
def test_engine_matches_learner(max_batch, chunk):
    model = _engine_model()
    outs = _generate(model, _prompts(max_batch, min(max_batch + 2, 12), 24), max_batch, chunk)
    diff, total = count_diff(model, outs)
    assert total > 0 and diff == 0


def test_prefix_cache_hits_continue_bit_for_bit():
    model = _engine_model(q_lora_rank=None)
    shared = torch.randint(0, 48, (35,), generator=torch.Generator().manual_seed(6)).tolist()
    prompts = [shared + tail for tail in _prompts(7, 3, 11)]
    cold = _generate(model, prompts, 4, 6, RolloutEngine(model, max_batch_size=4, prefill_chunk=6, prefix_cache_blocks=0))
    warm_engine = RolloutEngine(model, max_batch_size=4, prefill_chunk=6)
    _generate(model, prompts[:1], 4, 6, warm_engine)
    warm = _generate(model, prompts, 4, 6, warm_engine)
    assert warm_engine.stats["prefix_hit_tokens"] >= 3 * 2 * 16  # two 16-token blocks each
    for a, b in zip(cold, warm):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    assert count_diff(model, warm)[0] == 0


def test_fast_mode_differs():
    """Negative control: with library kernels the rollout's logprobs differ from the learner's somewhere."""
    model = _engine_model()
    with ops.use_kernels("fast"):
        assert count_diff(model, _generate(model, _prompts(5, 16, 24, 8), 12, 7))[0] > 0


def _routing_diff(mode: str) -> int:
    """Tokens of any MoE layer whose experts differ between the learner's batch and the rollout's steps (mixed
    prefill chunks and single tokens against the latent cache), with near-tied routers."""
    model = _engine_model()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            w = layer.mlp.gate.weight
            w.copy_(w[0] * (1 + 1e-6 * torch.randn(w.shape, generator=g)))
            layer.mlp.gate.e_score_correction_bias.zero_()
    ids = torch.randint(0, 48, (6, 24), generator=torch.Generator().manual_seed(8))
    with ops.use_kernels(mode):
        learner, rollout = learner_routing(model, ids), rollout_routing(model, ids, [1, 5, 2, 9])
    assert learner.keys() == rollout.keys()
    return sum(learner[key] != rollout[key] for key in learner)


def test_routing_is_recomputed_identically_and_differs_with_fast_kernels():
    assert _routing_diff("consistent") == 0
    assert _routing_diff("fast") > 0


# -- training -----------------------------------------------------------------------------------------------
def test_deepseek_tiny_preset_trains_with_zero_mismatch(tmp_path):
    """`python -m nemo_rz.train --config deepseek_tiny` (latent attention, a dense first layer, 8 routed experts
    in 2 groups, a shared expert) trains: every update's rollout logprobs and expert choices equal the
    learner's. (The negative control, fast kernels differing on this model, is test_fast_mode_differs: one
    more training run would cost ~15 s.)"""
    saved, rows = preset_run("deepseek_tiny", tmp_path / "run", "runtime.rollout_kernels=consistent")
    assert "attention_kind: mla" in saved and "moe_kind: deepseek" in saved
    assert len(rows) == 3
    assert all(r["kernel_diff_tokens"] == 0 and r["routing_diff_tokens"] == 0 and r["tokens"] > 0 for r in rows)


def test_model_extra_keys_are_checked():
    """model.extra passes DecoderConfig fields to a fresh model; a key the model section owns, or an unknown one,
    is one clear error."""
    from nemo_rz.config import load
    from nemo_rz.runtime.build import build_model
    from nemo_rz.schema import typed
    from nemo_rz.tasks.tokenizer import CharTokenizer

    def model(**extra):
        return build_model(typed(load("deepseek_tiny", [f"model.extra={json.dumps(extra)}"])).model, CharTokenizer())

    preset = build_model(typed(load("deepseek_tiny")).model, CharTokenizer())
    assert preset.config.attention_kind == "mla" and preset.config.moe_layers == [1] and preset.config.n_shared_experts == 1
    with pytest.raises(ValueError, match="model.extra.num_heads: the model section sets it; use model.num_heads"):
        model(num_heads=2)
    with pytest.raises(ValueError, match="unknown keys"):
        model(kv_lora=8)


def test_the_megatron_learner_refuses_the_family_in_one_line():
    spec = pytest.importorskip("nemo_rz.runtime.megatron.spec")
    for cfg in (_engine_model().config, _engine_model(moe_kind="qwen3").config, _engine_model(num_experts=0).config):
        for fast in (False, True):
            with pytest.raises(ValueError, match="the Megatron learner does not build latent attention or DeepSeek routing") as e:
                spec.check_supported(cfg, fast)
            assert "\n" not in str(e.value)
    spec.check_supported(DecoderConfig(), False)  # the control: a plain model passes
