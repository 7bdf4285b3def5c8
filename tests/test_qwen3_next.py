"""The Qwen3-Next family (Qwen3NextForCausalLM): Gated DeltaNet layers, gated full attention with partial RoPE,
zero-centred norms, MoE with a shared expert.

- Parity: random tiny checkpoints built with transformers' own Qwen3NextConfig (MoE and dense, Hv = Hk and
  Hv = 2 Hk, several chunks) load with logits within 1e-4 of transformers' float32 reference (its torch
  fallback path: FLA is not installed), save back in a form transformers loads, round-trip exactly; `mtp.*`
  tensors are skipped. Negative control: the per-key-head interleave of in_proj_qkvz undone gives a visible
  difference. transformers takes beta's sigmoid in the model dtype, nemo-rz in float32: identical in float32.
- The Megatron learner and the vLLM backend are refused for the family (megatron_tensors None,
  linear_attention True).
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import assert_saved_reloads, hf_logits, logit_diff

from nemo_rz.models import load_hf, save_hf
from nemo_rz.models.families import by_architecture

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256)
VARIANTS = {
    "moe": {},
    "dense-equal-heads": dict(num_experts=0, linear_num_value_heads=2, num_hidden_layers=3, full_attention_interval=3,
                              partial_rotary_factor=0.5),
}


@functools.cache
def _hf_dir(variant: str, root) -> str:
    cfg = transformers.Qwen3NextConfig(**{**BASE, **VARIANTS[variant]})
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-trivial values everywhere; A_log drawn as transformers' init does, but seeded
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            else:
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.15 * torch.randn(p.shape, generator=g))
    path = root / variant
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("qwen3_next")


def _ids() -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (2, 130), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_transformers_and_round_trips(variant, hf_root, tmp_path):
    path = _hf_dir(variant, hf_root)
    ids = _ids()
    expected = hf_logits(path, ids)
    model = load_hf(path)
    cfg = model.config
    assert cfg.has_linear_attention and cfg.attention_output_gate and cfg.norm == "gemma"
    assert logit_diff(model, ids, expected) < TOL
    save_hf(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3NextForCausalLM"] and saved["layer_types"] == cfg.layer_types
    assert_saved_reloads(model, tmp_path / "saved", ids, expected, TOL)


def test_interleave_matters(hf_root):
    """Negative control: in_proj_qkvz read as [all q; all k; all v; all z] instead of per key head is visibly off."""
    path = _hf_dir("moe", hf_root)
    ids = _ids()[:, :40]
    expected = hf_logits(path, ids)
    model = load_hf(path)
    cfg = model.config
    hk, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    with torch.no_grad():
        w = model.model.layers[0].linear_attn.in_proj_qkvz.weight
        per_head = w.view(hk, 2 * dk + 2 * (hv // hk) * dv, -1)
        parts = torch.split(per_head, [dk, dk, hv // hk * dv, hv // hk * dv], dim=1)
        w.copy_(torch.cat([p.reshape(-1, w.shape[1]) for p in parts]).view_as(w))
    assert logit_diff(model, ids, expected) > 1e-2


def test_mtp_tensors_skipped_and_other_back_ends_refused(hf_root, tmp_path):
    from safetensors.torch import load_file, save_file

    src = _hf_dir("moe", hf_root)
    tensors = load_file(f"{src}/model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    ids = _ids()[:, :20]
    assert logit_diff(load_hf(tmp_path), ids, hf_logits(src, ids)) < TOL
    fam = by_architecture("Qwen3NextForCausalLM")
    assert fam.megatron_tensors() is None and fam.linear_attention
