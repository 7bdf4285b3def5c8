"""Model families beyond the dense Qwen/Llama base: Qwen3-MoE, gpt-oss, Gemma 3 (text), Mistral with a sliding
window, Qwen2's mixed window layers, RoPE scaling.

- Parity: checkpoints built with transformers' own config classes (random init) load with logits within 1e-4 of
  transformers in float32, save back in a form transformers loads, and round-trip exactly. Negative controls: a
  wrong layer type, routing rule or RoPE table gives a visible difference.
- Zero mismatch: the built-in engine's logprobs equal the learner's bit for bit for MoE and mixed-window models
  (batches, chunked prefill, prompts longer than the window, prefix-cache hits across the window), and every
  token's expert choice is the same in rollout and learner; in fast mode both differ somewhere.
"""
from __future__ import annotations

import functools
import importlib
import json

import pytest
import torch
from conftest import assert_saved_reloads, count_diff, hf_logits, learner_routing, logit_diff, preset_run, rollout_routing
from safetensors.torch import save_file

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig, ModelFileError, config_from_hf, load_hf, save_hf

rope_ops = importlib.import_module("nemo_rz.ops.rope")  # the module (nemo_rz.ops.rope is also the function)
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
SMALL = dict(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
WINDOW = 8
YARN = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0, beta_slow=1.0)
LLAMA3 = dict(rope_type="llama3", rope_theta=5e5, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)
# name -> (transformers config class, overrides)
FAMILIES = {
    "qwen3-moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                        norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3-moe-sliding": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                                num_experts_per_tok=2, decoder_sparse_step=2, use_sliding_window=True,
                                                sliding_window=WINDOW, attention_bias=True)),
    "qwen2-moe-shared-expert": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                      num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                                      mlp_only_layers=[2], use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=2)),
    "gpt-oss": ("GptOssConfig", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                                     rope_parameters=dict(YARN, truncate=False))),
    "gemma3": ("Gemma3TextConfig", dict(intermediate_size=96, sliding_window=WINDOW, sliding_window_pattern=2,
                                        query_pre_attn_scalar=24)),
    "gemma3-linear-rope": ("Gemma3TextConfig", dict(intermediate_size=96, sliding_window=WINDOW, tie_word_embeddings=False,
                                                    rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                                                                     "sliding_attention": dict(rope_type="default", rope_theta=1e4)})),
    "mistral-sliding": ("MistralConfig", dict(intermediate_size=96, sliding_window=WINDOW)),
    "qwen2-window-mix": ("Qwen2Config", dict(intermediate_size=96, use_sliding_window=True, sliding_window=WINDOW,
                                             max_window_layers=2)),
    "qwen3-yarn": ("Qwen3Config", dict(intermediate_size=96, rope_parameters=YARN, attention_bias=True)),
    "llama3-rope": ("LlamaConfig", dict(intermediate_size=96, rope_parameters=LLAMA3)),
}


def _randomize(model: torch.nn.Module, seed: int, qk_norm_scale: float = 0.5) -> None:
    """Non-trivial values everywhere (norms around their neutral value, biases, sinks, experts)."""
    g = torch.Generator().manual_seed(seed)
    neutral = 0.0 if "Gemma" in type(model).__name__ else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                scale = qk_norm_scale if name.endswith(("q_norm.weight", "k_norm.weight")) else 0.5
                p.copy_(neutral + scale * torch.randn(p.shape, generator=g))
            elif name.endswith(("bias", "sinks")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


@functools.cache
def _hf_dir(family: str, root) -> str:
    cls, overrides = FAMILIES[family]
    cfg = getattr(transformers, cls)(**SMALL, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    _randomize(model, 0)
    path = root / family
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _ids(length: int = 3 * WINDOW + 5, batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


# -- parity with transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_and_round_trips(family, hf_root, tmp_path):
    path = _hf_dir(family, hf_root)
    ids = _ids()
    expected = hf_logits(path, ids)
    model = load_hf(path)
    assert logit_diff(model, ids, expected) < TOL
    assert logit_diff(model, ids, expected, "fast") < TOL
    save_hf(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == json.loads(open(f"{path}/config.json").read())["architectures"]
    assert_saved_reloads(model, tmp_path / "saved", ids, expected, TOL)


def test_family_structure_is_read_per_layer(hf_root):
    moe = load_hf(_hf_dir("qwen3-moe", hf_root)).config
    assert [moe.is_moe(i) for i in range(4)] == [True, False, True, True] and moe.norm_topk_prob
    oss = load_hf(_hf_dir("gpt-oss", hf_root)).config
    assert oss.windows() == [WINDOW, None, WINDOW, None] and oss.attention_sinks and oss.rope_scaling["rope_type"] == "yarn"
    gemma = load_hf(_hf_dir("gemma3", hf_root)).config
    assert gemma.windows() == [WINDOW, None, WINDOW, None] and gemma.rope(0) == (1e4, None) and gemma.rope(1) == (1e6, None)
    mix = load_hf(_hf_dir("qwen2-window-mix", hf_root)).config
    assert mix.windows() == [None, None, WINDOW, WINDOW]
    assert load_hf(_hf_dir("mistral-sliding", hf_root)).config.windows() == [WINDOW] * 4


@pytest.mark.parametrize("family, breakage", [
    ("gpt-oss", lambda m: setattr(m.config, "layer_types", ["full_attention", "sliding_attention"] * 2)),
    ("gemma3", lambda m: setattr(m.config, "rope_local_theta", None)),
    ("qwen3-moe", lambda m: setattr(m.config, "norm_topk_prob", False)),
    ("gpt-oss", lambda m: setattr(m.config, "rope_scaling", None)),
    ("gpt-oss", lambda m: m.model.layers[1].self_attn.sinks.data.zero_()),
])
def test_negative_controls_the_parity_bound_can_fail(family, breakage, hf_root):
    path = _hf_dir(family, hf_root)
    ids = _ids()
    model = load_hf(path)
    breakage(model)
    assert logit_diff(model, ids, hf_logits(path, ids)) > 100 * TOL


def _f64_table(head_dim, theta, scaling, length, device):
    """The RoPE table with the same frequencies but float64 angles: what transformers does not do."""
    freq, attention = rope_ops.inv_freq(head_dim, theta, scaling)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * freq.double()[None, :]  # exact products
    cos, sin = angles.cos().float() * attention, angles.sin().float() * attention
    return torch.cat([cos, cos], -1).to(device), torch.cat([-sin, sin], -1).to(device)


@pytest.mark.parametrize("family", ["gemma3", "gemma3-linear-rope", "gpt-oss", "llama3-rope"])
def test_rope_tables_equal_transformers(family, hf_root):
    """cos/sin of every position up to 4096 within 2.4e-7 of transformers' rotary embedding (float32 angles; with
    Gemma 3's large q/k-norm weights an angle error becomes a logit error of ~1e-3). Negative control: float64
    angles."""
    path = _hf_dir(family, hf_root)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.rotary_emb
    cfg = load_hf(path).config
    positions = torch.arange(4096)[None]
    for layer in range(cfg.num_layers):
        kind = {"layer_type": "sliding_attention" if cfg.window(layer) else "full_attention"} if "gemma" in family else {}
        with torch.no_grad():
            cos, sin = (t[0, :, : cfg.head_dim // 2] for t in ref(torch.zeros(1, dtype=torch.float32), positions, **kind))
        theta, scaling = cfg.rope(layer)
        for (cos2, sin2), close in ((rope_ops.rope_table(cfg.head_dim, theta, 4096, "cpu", scaling), True),
                                    (_f64_table(cfg.head_dim, theta, scaling, 4096, "cpu"), False)):
            diff = max((cos2[:4096, cfg.head_dim // 2:] - cos).abs().max().item(),
                       (sin2[:4096, cfg.head_dim // 2:] - sin).abs().max().item())
            assert diff <= 2.4e-7 if close else diff > 1e-5, (layer, close, diff)


def test_rope_frequencies_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, params in (("yarn", dict(YARN, truncate=False)), ("yarn", YARN), ("llama3", LLAMA3),
                         ("linear", dict(rope_type="linear", rope_theta=1e4, factor=4.0))):
        cfg = transformers.LlamaConfig(**SMALL, rope_parameters=dict(params), max_position_embeddings=128)
        expected, attention = ROPE_INIT_FUNCTIONS[name](cfg, "cpu")
        mine = config_from_hf(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
        freq, factor = rope_ops.inv_freq(16, mine.rope_theta, mine.rope_scaling_rule)
        assert torch.equal(freq, expected.float()) and factor == attention, name


def test_legacy_config_forms_read_as_transformers_reads_them(hf_root):
    """transformers 4.x configs: Gemma 3's rope_scaling (the full layers') with rope_local_base_freq, gpt-oss's
    rope_scaling with a top-level rope_theta."""
    nested = load_hf(_hf_dir("gemma3-linear-rope", hf_root)).config
    d = json.loads(open(f"{_hf_dir('gemma3-linear-rope', hf_root)}/config.json").read())
    rope = d.pop("rope_parameters")
    legacy = d | dict(rope_scaling=dict(rope_type="linear", factor=8.0), rope_theta=rope["full_attention"]["rope_theta"],
                      rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    assert config_from_hf(legacy) == nested
    oss = load_hf(_hf_dir("gpt-oss", hf_root)).config
    d = json.loads(open(f"{_hf_dir('gpt-oss', hf_root)}/config.json").read())
    rope = d.pop("rope_parameters")
    assert config_from_hf(d | dict(rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"}, rope_theta=rope["rope_theta"])) == oss


# -- checkpoint layouts and refusals ---------------------------------------------------------------------
def test_qwen3_moe_loads_stacked_experts_and_either_expert_count_key(hf_root, tmp_path):
    path = _hf_dir("qwen3-moe", hf_root)
    model = load_hf(path)
    # transformers v5's in-memory layout (stacked experts) written as is, with the hub's `num_experts` key
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    d = json.loads(open(f"{path}/config.json").read())
    d["num_experts"] = d.pop("num_local_experts")
    (tmp_path / "config.json").write_text(json.dumps(d))
    again = load_hf(tmp_path)
    assert again.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("family, change, fragment", [
    ("gemma3", dict(final_logit_softcapping=30.0), "soft-capping"),
    ("gemma3", dict(attn_logit_softcapping=50.0), "soft-capping"),
    ("gemma3", dict(use_bidirectional_attention=True), "causal"),
    ("gemma3", dict(hidden_activation="gelu"), "gelu_pytorch_tanh"),
    ("gpt-oss", dict(swiglu_alpha=1.5), "1.702"),
    ("gpt-oss", dict(num_experts_per_tok=9), "more than the 4 experts"),
    ("qwen3-moe", dict(mlp_only_layers="1"), "mlp_only_layers"),
    ("gemma3", dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e6),
                                     "sliding_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e4)}),
     "sliding layers' RoPE"),
])
def test_unsupported_family_values_raise_one_line(family, change, fragment, hf_root, tmp_path):
    d = json.loads(open(f"{_hf_dir(family, hf_root)}/config.json").read()) | change
    with pytest.raises(ModelFileError) as info:
        config_from_hf(d, str(tmp_path / "config.json"))
    message = str(info.value)
    assert fragment in message and "\n" not in message and ";" in message and str(tmp_path) in message


# -- zero mismatch in the built-in engine ------------------------------------------------------------------
ENGINE_MODELS = {
    "gpt-oss-like": dict(num_experts=4, num_experts_per_tok=2, moe_kind="gpt_oss", attention_sinks=True, norm="rms_f32",
                         attention_bias=True, o_proj_bias=True, moe_layers=[0, 2], qk_norm=False,
                         rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
    "qwen3-moe-like": dict(num_experts=6, num_experts_per_tok=2, moe_kind="qwen3", norm_topk_prob=False),
    "qwen2-moe-like": dict(num_experts=6, num_experts_per_tok=2, moe_kind="qwen3", shared_expert_intermediate_size=40,
                           qk_norm=False, attention_bias=True),
    "gemma-like": dict(norm="gemma", sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True, rope_local_theta=1e4,
                       query_pre_attn_scalar=24.0, tie_word_embeddings=True),
}


def _engine_model(kind: str, seed: int = 0, dtype: str = "float32") -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=48, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_layers=3,
                        num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=WINDOW, dtype=dtype,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"], **ENGINE_MODELS[kind])
    model = Decoder(cfg)
    with torch.no_grad():  # peaky, varied distributions (as conftest.tiny_model)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    return model.eval()


def _prompts(seed: int, n: int, max_len: int, min_len: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in lengths]


def _generate(model, prompts, max_batch_size, prefill_chunk, engine=None, seed=4):
    engine = engine or RolloutEngine(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk)
    return engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=seed, stop_token_ids=(0, 1)))


@pytest.mark.parametrize("kind, max_batch, chunk", [
    ("gpt-oss-like", 7, 5), ("qwen3-moe-like", 7, 5), ("gemma-like", 7, 5), ("qwen3-moe-like", 64, 3), ("gpt-oss-like", 1, None),
    ("qwen2-moe-like", 7, 5),
])
def test_engine_matches_learner(kind, max_batch, chunk):
    model = _engine_model(kind)
    outs = _generate(model, _prompts(max_batch, min(2 * max_batch + 3, 20), 3 * WINDOW), max_batch, chunk)
    diff, total = count_diff(model, outs)
    assert total > 0 and diff == 0


def test_bf16_moe_model_matches_its_learner():
    """bfloat16 weights (float32 router logits): zero mismatch in consistent mode, differences in fast mode."""
    model = _engine_model("gpt-oss-like", dtype="bfloat16")
    prompts = _prompts(3, 12, 4 * WINDOW)
    assert count_diff(model, _generate(model, prompts, 7, 5))[0] == 0
    with ops.use_kernels("fast"):
        assert count_diff(model, _generate(model, prompts, 7, 5))[0] > 0


@pytest.mark.parametrize("kind", list(ENGINE_MODELS))
def test_fast_mode_differs(kind):
    """Negative control: with library kernels the rollout's logprobs differ from the learner's somewhere."""
    model = _engine_model(kind)
    prompts = _prompts(5, 24, 4 * WINDOW, WINDOW)
    with ops.use_kernels("fast"):
        outs = _generate(model, prompts, 12, 7)
        assert count_diff(model, outs)[0] > 0


@pytest.mark.parametrize("kind", ["gpt-oss-like", "gemma-like"])
def test_prefix_cache_hits_across_the_window(kind):
    """A cached prefix longer than the window continues with the bits of a cold run, and the learner's."""
    model = _engine_model(kind)
    shared = torch.randint(0, 48, (4 * WINDOW + 3,), generator=torch.Generator().manual_seed(6)).tolist()
    prompts = [shared + tail for tail in _prompts(7, 5, WINDOW + 3)]
    cold = _generate(model, prompts, 4, 6, RolloutEngine(model, max_batch_size=4, prefill_chunk=6, prefix_cache_blocks=0))
    warm_engine = RolloutEngine(model, max_batch_size=4, prefill_chunk=6)
    _generate(model, prompts[:1], 4, 6, warm_engine)
    warm = _generate(model, prompts, 4, 6, warm_engine)
    assert warm_engine.stats["prefix_hit_tokens"] >= 5 * 2 * 16  # two 16-token blocks each: past the window
    for a, b in zip(cold, warm):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
    assert count_diff(model, warm)[0] == 0


def _tie_prone(model: Decoder) -> Decoder:
    """Every router row within a relative 1e-6 of the first: each token's choice hangs on the last bits."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers:
            router = getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None)
            if router is not None:
                router.weight.copy_(router.weight[0] * (1 + 1e-6 * torch.randn(router.weight.shape, generator=g)))
    return model


def _routing_diff(kind: str, mode: str) -> int:
    """Tokens of any MoE layer whose experts differ between the learner's batch and the rollout's steps."""
    model = _tie_prone(_engine_model(kind))
    ids = torch.randint(0, 48, (6, 3 * WINDOW), generator=torch.Generator().manual_seed(8))
    with ops.use_kernels(mode):
        learner = learner_routing(model, ids)
        rollout = rollout_routing(model, ids, [1, 5, 2, 9])
    assert learner.keys() == rollout.keys()
    return sum(learner[key] != rollout[key] for key in learner)


@pytest.mark.parametrize("kind", ["gpt-oss-like", "qwen3-moe-like"])
def test_routing_is_recomputed_identically(kind):
    """Every token's experts in the learner's batch equal those of the rollout's steps (mixed prefill chunks and
    single tokens against a KV cache), with near-tied routers and no routing replay."""
    assert _routing_diff(kind, "consistent") == 0


def test_routing_differs_with_fast_kernels():
    """Negative control: with library kernels the same near-tied routers choose differently for some tokens."""
    assert _routing_diff("qwen3-moe-like", "fast") > 0


# -- training ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rollout_kernels", ["consistent", "fast"])
def test_moe_tiny_preset_trains_with_zero_mismatch(rollout_kernels, tmp_path):
    """`python -m nemo_rz.train --config moe_tiny` (MoE layers, a sliding-window layer, sinks) trains: every
    update's rollout logprobs and expert choices equal the learner's. Negative control: fast rollout kernels."""
    saved, rows = preset_run("moe_tiny", tmp_path / "run", f"runtime.rollout_kernels={rollout_kernels}")
    assert "num_experts: 4" in saved and "sliding_window: 8" in saved
    assert len(rows) == 3
    if rollout_kernels == "consistent":
        assert all(r["kernel_diff_tokens"] == 0 and r["routing_diff_tokens"] == 0 for r in rows)
    else:
        assert any(r["kernel_diff_tokens"] > 0 for r in rows)
