"""Kimi Linear (KimiLinearForCausalLM): Kimi Delta Attention (a per-key-channel decay on the chunk-synchronised
delta rule of ops/delta_rule.py), MLA full-attention layers without RoPE, DeepSeek-style MoE.

- Parity: random tiny checkpoints built with transformers' own KimiLinearConfig (MoE with a mild decay, so the
  state carries across three chunks; dense with q_lora_rank) load with logits within 1e-4 of transformers'
  float32 reference (its torch fallback: FLA is not installed), save back in a form transformers loads and
  round-trip exactly; the hub's config.json keys (linear_attn_config, 1-indexed layer lists) and the hub's
  `mlp.` dense layers load as the same model. transformers takes beta's sigmoid in the model dtype, nemo-rz in
  float32: identical in float32. Negative control: the per-channel decay collapsed to its head mean (Gated
  DeltaNet's form) is visibly off.
- Built-in engine: torch.equal of a full forward against prefill(P) + decode for P in {1, 63, 64, 65, 130} and
  chunked prefill at 37; 0 differing tokens learner vs engine (batch 1 and 8, chunked prefill). Negative
  controls: fast kernels differ; transformers' standard forms (chunked prefill anchored at the call, then
  recurrent decode) differ from its own full forward.
- The vLLM backend and the Megatron learner refuse the family in one line.
"""
from __future__ import annotations

import functools
import importlib.util
import json

import pytest
import torch
from conftest import assert_saved_reloads, count_diff, hf_logits, logit_diff

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig, load_hf, save_hf
from nemo_rz.models.families import by_architecture

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, linear_head_dim=8,
            linear_num_heads=2, layer_types=["linear_attention", "full_attention", "linear_attention"],
            pad_token_id=None, bos_token_id=None, eos_token_id=None)
VARIANTS = {
    "moe": {},
    "dense-q-lora": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], q_lora_rank=12,
                         mlp_layer_types=["dense", "dense"]),
}


def _hf_model(variant: str):
    cfg = transformers.KimiLinearConfig(**{**BASE, **VARIANTS[variant]})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # a mild decay (rates 0.02-0.2): the state carries across chunks
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.2, generator=g).log())
            else:
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.15 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


@functools.cache
def _hf_dir(variant: str, root) -> str:
    path = root / variant
    _hf_model(variant).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("kimi_linear")


def _ids(length: int = 130) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_and_round_trips(variant, hf_root, tmp_path):
    path = _hf_dir(variant, hf_root)
    ids = _ids()
    expected = hf_logits(path, ids)
    model = load_hf(path)
    cfg = model.config
    assert cfg.linear_kind == "kda" and cfg.attention_kind == "mla" and not cfg.use_rope
    assert logit_diff(model, ids, expected) < TOL
    save_hf(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["KimiLinearForCausalLM"] and saved["layer_types"] == cfg.layer_types
    assert_saved_reloads(model, tmp_path / "saved", ids, expected, TOL)


def test_hub_config_and_dense_names_load(hf_root, tmp_path):
    """The hub's config.json (linear_attn_config with 1-indexed layer lists, first_k_dense_replace, hub key
    names) and its `mlp.` dense layer load as the model transformers saved."""
    from safetensors.torch import load_file, save_file

    src = _hf_dir("moe", hf_root)
    d = json.loads(open(f"{src}/config.json").read())
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        d.pop(key)
    d.update(linear_attn_config=dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, kda_layers=[1, 3],
                                     full_attn_layers=[2]), first_k_dense_replace=1, moe_layer_freq=1,
             moe_router_activation_func="sigmoid", mla_use_nope=True)
    (tmp_path / "config.json").write_text(json.dumps(d))
    tensors = load_file(f"{src}/model.safetensors")
    assert any(".layers.0.block_sparse_moe.gate_proj" in k for k in tensors)  # transformers' save names it so
    save_file({k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): t for k, t in tensors.items()},
              tmp_path / "model.safetensors")
    ids = _ids(40)
    ref = load_hf(src)
    hub = load_hf(tmp_path)
    assert hub.config == ref.config
    with torch.no_grad():
        assert torch.equal(hub(ids), ref(ids))
    d["linear_attn_config"]["full_attn_layers"] = [2, 3]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="must number each of the 3 layers once"):
        load_hf(tmp_path)


def test_per_channel_decay_matters(hf_root):
    """Negative control: the same layers with each head's decay averaged over its channels (Gated DeltaNet's
    one gate per head) are visibly off transformers."""
    path = _hf_dir("moe", hf_root)
    ids = _ids(70)
    expected = hf_logits(path, ids)
    model = load_hf(path)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "f_b_proj"):
                h, d = model.config.linear_num_value_heads, model.config.linear_value_head_dim
                w = attn.f_b_proj.weight.view(h, d, -1)
                w.copy_(w.mean(1, keepdim=True).expand_as(w))
                attn.dt_bias.copy_(attn.dt_bias.view(h, d).mean(1, keepdim=True).expand(h, d).reshape(-1))
    assert logit_diff(model, ids, expected) > 1e-2


# -- the built-in engine -------------------------------------------------------------------------------------
VOCAB = 48


def _model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    cfg = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=1,
                        head_dim=8, qk_norm=False, layer_types=["linear_attention", "full_attention"], linear_kind="kda",
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                        attention_kind="mla", kv_lora_rank=16, qk_nope_head_dim=8, v_head_dim=8, use_rope=False,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_kind="deepseek",
                        n_shared_experts=1, moe_layers=[1])
    model = Decoder(cfg)
    with torch.no_grad():  # peaky, varied distributions; a mild decay (the state matters across chunks)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.2).log())
            elif p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _decode(model, ids: torch.Tensor, prefill: int, chunk: int | None = None, steps: int | None = None) -> torch.Tensor:
    """Hidden states of ids through the cache: `prefill` tokens in calls of `chunk` (one call when None), then
    `steps` tokens (all the rest when None) one per call."""
    cache = model.new_cache(3, 256)
    slot, outs, p = 2, [], 0
    end = len(ids) if steps is None else prefill + steps
    while p < end:
        n = min(chunk or prefill, prefill - p) if p < prefill else 1
        outs.append(model.step(ids[p:p + n], torch.arange(p, p + n), torch.full((n,), slot), cache))
        p += n
    return torch.cat(outs)


def test_prefill_then_decode_equals_the_full_forward(model):
    ids = torch.randint(0, VOCAB, (136,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.hidden(model.tokens(ids[None]))
        for p in (1, 63, 64, 65, 130):  # 6 decode steps each: across the boundaries at 64 and 128 (and after 130)
            assert torch.equal(_decode(model, ids, p, steps=6), full[:p + 6]), p
        assert torch.equal(_decode(model, ids, 136, 37), full)  # chunked prefill, never aligned with the chunks


def _prompts(seed: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(58, 71, (n,), generator=g)]


def _generate(model, prompts, max_batch_size, prefill_chunk):
    engine = RolloutEngine(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk)
    assert engine.prefix_cache is None  # never a prefix-cache hit for a linear-attention model
    return engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=4, stop_token_ids=(0,)))


@pytest.mark.parametrize("max_batch, chunk", [(1, None), (8, 23)])
def test_engine_matches_learner(model, max_batch, chunk):
    prompts = _prompts(max_batch, max(max_batch, 2))
    prompts[1] = list(prompts[0])
    diff, total = count_diff(model, _generate(model, prompts, max_batch, chunk))
    assert total >= 8 * len(prompts) // 2 and diff == 0


def test_fast_mode_differs(model):
    """Negative control: with library kernels the rollout's logprobs differ from the learner's somewhere."""
    with ops.use_kernels("fast"):
        assert count_diff(model, _generate(model, _prompts(5, 8), 8, 23))[0] > 0


def test_transformers_standard_forms_differ():
    """Negative control: transformers' KDA torch forms, chunked prefill (chunks from the call's start) then
    recurrent decode, give other bits than its chunked forward over the whole sequence."""
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    g = torch.Generator().manual_seed(3)
    h, length, dk = 2, 140, 8
    q, k, v = (torch.randn(1, length, h, dk, generator=g) for _ in range(3))
    gate = -0.1 * torch.rand(1, length, h, dk, generator=g)
    beta = torch.rand(1, length, h, generator=g)
    args = dict(use_qk_l2norm_in_kernel=True)
    full, _ = hf.chunk_kimi_delta_attention(q, k, v, gate, beta, **args)
    differ = 0
    for p in (63, 65, 130):
        out, state = hf.chunk_kimi_delta_attention(q[:, :p], k[:, :p], v[:, :p], gate[:, :p], beta[:, :p],
                                                   output_final_state=True, **args)
        steps = [out]
        for t in range(p, length):
            o, state = hf.recurrent_kimi_delta_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gate[:, t:t + 1],
                                                         beta[:, t:t + 1], initial_state=state, output_final_state=True, **args)
            steps.append(o)
        differ += not torch.equal(torch.cat(steps, 1), full)
        assert (torch.cat(steps, 1) - full).abs().max() < 1e-4  # the same function, other rounding
    assert differ == 3


def test_refusals_and_state(model):
    cache = model.new_cache(2, 64)
    state = cache.linear[0]
    assert set(cache.linear) == {0} and state.g.shape == (2, 2, 64, 8)  # one decay per key channel
    assert all(t.dtype == torch.float32 for t in state.tensors())
    with pytest.raises(ValueError, match="linear_kind='kda' has one head count"):
        DecoderConfig(**{**model.config.to_dict(), "linear_num_key_heads": 1})
    fam = by_architecture("KimiLinearForCausalLM")
    assert fam.megatron_tensors() is None and fam.linear_attention
    if importlib.util.find_spec("vllm") is not None:  # refused before any vLLM engine starts
        from nemo_rz.generation.vllm import VLLMRolloutEngine

        with pytest.raises(ValueError, match="linear-attention .* no recurrent-state cache in the vLLM backend"):
            VLLMRolloutEngine(model, multiprocess=False)
