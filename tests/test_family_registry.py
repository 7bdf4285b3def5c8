"""The family registry (nemo_rz.models.families): one module per family, one table; adding a family is one
module (or one `register` call), with nothing else to touch."""
from __future__ import annotations

import dataclasses
import importlib
import json
import pathlib
import re

import pytest
import torch

import nemo_rz
from nemo_rz.models import Decoder, config_from_hf, families, hf_config, load_hf, save_hf
from nemo_rz.models.families import base, llama

hf_config_module = importlib.import_module("nemo_rz.models.hf_config")  # nemo_rz.models.hf_config is also the function
PACKAGE = pathlib.Path(families.__file__).parent
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


def test_registry_lists_exactly_the_modules_of_the_package():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "base"}
    assert set(families.MODULES) == modules == {"llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "gpt_oss", "gemma3",
                                                         "deepseek_v3", "qwen2_moe", "qwen3_next",
                                                         "kimi_linear", "deepseek_v4", "qwen3_5"}
    assert len(families.TABLE) == len(modules)
    assert list(hf_config_module.ARCHITECTURES) == list(families.TABLE)
    for name in modules:
        fam = __import__(f"nemo_rz.models.families.{name}", fromlist=["FAMILY"]).FAMILY
        assert families.by_architecture(fam.architecture) is fam and families.by_model_type(fam.model_type) is fam


def test_lookups():
    assert families.by_architecture("PhiForCausalLM") is None and families.by_model_type("phi") is None
    assert families.by_gguf_arch("llama").architecture == "LlamaForCausalLM"  # not Mistral, whose GGUFs say llama too
    assert families.by_gguf_arch("qwen3moe").architecture == "Qwen3MoeForCausalLM"
    assert set(families.gguf_architectures()) == {"llama", "qwen2", "qwen3", "qwen3moe", "gemma3"}
    for arch in families.TABLE:  # every family's natural config is saved as itself
        v4 = dict(partial_rotary_factor=0.5, o_groups=2) if arch == "DeepseekV4ForCausalLM" else {}  # V4: 1/8 of 8 dims, 8 groups
        cfg = config_from_hf({"architectures": [arch], **SMALL, **v4})
        if arch != "MistralForCausalLM":  # a Mistral without a window is a Llama
            assert families.for_config(cfg).architecture == arch, arch


def test_gpt_oss_activation_constant_is_defined_once():
    root = pathlib.Path(nemo_rz.__file__).parent
    holders = [p.relative_to(root).as_posix() for p in root.rglob("*.py") if re.search(r"\b1\.702\b", p.read_text())]
    assert holders == ["models/families/gpt_oss.py"]


def test_a_family_registered_at_run_time_loads_and_saves(tmp_path):
    """A copy of Llama under a new architecture name: registering it is all it takes for config_from_hf,
    hf_config, save_hf and load_hf to handle it."""
    tiny = dataclasses.replace(llama.FAMILY, architecture="TinyLlamaForCausalLM", model_type="tiny_llama", rank=1000)
    assert isinstance(tiny, base.Family)
    with pytest.raises(ValueError, match="unsupported architecture 'TinyLlamaForCausalLM'"):
        config_from_hf({"architectures": ["TinyLlamaForCausalLM"], **SMALL})
    families.register(tiny)
    try:
        assert "TinyLlamaForCausalLM" in hf_config_module.SUPPORTED
        cfg = config_from_hf({"architectures": ["TinyLlamaForCausalLM"], **SMALL})
        assert cfg == config_from_hf({"architectures": ["LlamaForCausalLM"], **SMALL})
        assert families.for_config(cfg).architecture == "LlamaForCausalLM"  # the copy claims no one's default
        torch.manual_seed(0)
        model = Decoder(cfg).eval()
        out = save_hf(model, tmp_path / "tiny", architecture="TinyLlamaForCausalLM")
        written = json.loads((out / "config.json").read_text())
        assert written["architectures"] == ["TinyLlamaForCausalLM"] and written["model_type"] == "tiny_llama"
        assert written == {**hf_config(cfg, "LlamaForCausalLM"), "architectures": ["TinyLlamaForCausalLM"], "model_type": "tiny_llama"}
        back = load_hf(out)
        assert back.config == cfg
        assert all(torch.equal(back.state_dict()[k], v) for k, v in model.state_dict().items())
        del written["architectures"]  # found by its model_type too
        (out / "config.json").write_text(json.dumps(written))
        assert load_hf(out).config == cfg
    finally:
        families.unregister("TinyLlamaForCausalLM")
    assert families.by_architecture("TinyLlamaForCausalLM") is None
