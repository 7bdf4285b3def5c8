"""Qwen3.5 text (Qwen3_5ForCausalLM): Qwen3-Next's Gated DeltaNet with split projections (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a), gated full attention with partial RoPE, zero-centred norms, dense MLPs.

- Parity: a random tiny checkpoint built with transformers' own Qwen3_5TextConfig (Hv = 2 Hk, three chunks) loads
  with logits within 1e-4 of transformers' float32 reference (its torch fallback), saves back as Qwen3.5 in a
  form transformers loads and round-trips exactly.
- The split layer is Qwen3-Next's: the same weights regrouped per key head into in_proj_qkvz / in_proj_ba give
  the same logits (within 1e-4) on a linear_kind="gated_deltanet" model; negative control: concatenated without
  the per-key-head regrouping they are visibly off.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import pytest
import torch
from conftest import assert_saved_reloads, hf_logits, logit_diff

from nemo_rz.models import Decoder, load_hf, save_hf

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=12, layer_types=["linear_attention", "full_attention"], max_position_embeddings=256)


@functools.cache
def _hf_dir(root) -> str:
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**CFG), attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # transformers' init distribution, seeded: the same model every run
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            else:
                p.copy_((1.0 if name.endswith("linear_attn.norm.weight") else 0.0) + 0.15 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root / "qwen3_5")
    return str(root / "qwen3_5")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return _hf_dir(tmp_path_factory.mktemp("qwen3_5"))


def _ids() -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (2, 130), generator=torch.Generator().manual_seed(1))


def test_matches_transformers_and_round_trips(path, tmp_path):
    ids = _ids()
    expected = hf_logits(path, ids)
    model = load_hf(path)
    cfg = model.config
    assert cfg.linear_kind == "gated_deltanet_split" and cfg.num_experts == 0 and cfg.attention_output_gate
    assert logit_diff(model, ids, expected) < TOL
    save_hf(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3_5ForCausalLM"] and "num_experts" not in saved
    assert_saved_reloads(model, tmp_path / "saved", ids, expected, TOL)


@pytest.mark.parametrize("regrouped", [True, False])
def test_split_projections_are_qwen3_next_regrouped(path, regrouped):
    ids = _ids()[:, :40]
    expected = hf_logits(path, ids)
    split = load_hf(path)
    cfg = split.config
    fused = Decoder(dataclasses.replace(cfg, linear_kind="gated_deltanet")).eval()
    hk, r, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads, \
        cfg.linear_key_head_dim, cfg.linear_value_head_dim
    state = dict(split.state_dict())
    pre = "model.layers.0.linear_attn."
    qkv, z, b, a = (state.pop(f"{pre}in_proj_{p}.weight") for p in ("qkv", "z", "b", "a"))
    if regrouped:  # per key head: its q, k, then its group's v and z rows; its group's b, then a
        q, k, v = torch.split(qkv, [hk * dk, hk * dk, hk * r * dv])
        state[f"{pre}in_proj_qkvz.weight"] = torch.cat([q.view(hk, dk, -1), k.view(hk, dk, -1), v.view(hk, r * dv, -1),
                                                         z.view(hk, r * dv, -1)], 1).reshape(-1, qkv.shape[1])
        state[f"{pre}in_proj_ba.weight"] = torch.cat([b.view(hk, r, -1), a.view(hk, r, -1)], 1).reshape(-1, qkv.shape[1])
    else:
        state[f"{pre}in_proj_qkvz.weight"], state[f"{pre}in_proj_ba.weight"] = torch.cat([qkv, z]), torch.cat([b, a])
    with torch.no_grad():
        for name, p in fused.state_dict().items():
            p.copy_(state[name])
    diff = logit_diff(fused, ids, expected)
    assert diff < TOL if regrouped else diff > 1e-2
