"""load_hf reads quantized release checkpoints: FP8 block-scaled (DeepSeek-V3 / Qwen3-FP8 layout) and gpt-oss's
MXFP4 experts, decoded exactly to the float master weights (each value one fp32 product of code and scale).

The checkpoints are built here: a transformers model's weights quantized into each release format and written
with its quantization_config. Negative controls: the decoded values differ from the float weights they came from
(the load really read the codes), and damaged or unsupported checkpoints are refused in one line.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_rz.models import ModelFileError, load_hf
from nemo_rz.quant import quantize

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

LINEARS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight",
           "down_proj.weight")


def _float_checkpoint(path, config):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def _write(path, tensors, quantization_config):
    save_file(tensors, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))


def _fp8_tiles(w):
    """(E4M3 codes, float32 scale_inv per 128x128 tile, decoded values) as FP8 releases store them (scale = tile
    amax / 448; the last tiles of a side that 128 does not divide are partial)."""
    n, k = w.shape
    tn, tk = -(-n // 128), -(-k // 128)
    tiles = torch.nn.functional.pad(w, (0, tk * 128 - k, 0, tn * 128 - n)).view(tn, 128, tk, 128)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / 448.0).float()
    per_element = scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    codes = (w / per_element).to(torch.float8_e4m3fn)
    return codes, scale_inv, codes.float() * per_element


@pytest.fixture
def fp8_checkpoint(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
    tensors, expected = _float_checkpoint(tmp_path, cfg), {}
    for name in [n for n in tensors if n.endswith(LINEARS)]:
        codes, scale_inv, expected[name] = _fp8_tiles(tensors[name])
        tensors[name], tensors[name + "_scale_inv"] = codes, scale_inv
    _write(tmp_path, tensors, {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                               "activation_scheme": "dynamic"})
    return tmp_path, expected


def test_fp8_block_checkpoint_decodes_exactly(fp8_checkpoint):
    path, expected = fp8_checkpoint
    params = dict(load_hf(path).named_parameters())
    for name, values in expected.items():
        assert torch.equal(params[name], values), name
    float_weights = load_file(str(path / "model.safetensors"))  # the codes, not the original floats
    assert float_weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_gpt_oss_mxfp4_experts_decode_exactly(tmp_path):
    cfg = transformers.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=16)
    tensors, expected = _float_checkpoint(tmp_path, cfg), {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name)  # [E, in, out]; the release stores [E, out, in / 32, 16] blocks and [E, out, in / 32] scales
        e, k, n = w.shape
        q = quantize(w.transpose(1, 2).contiguous(), "mxfp4", role="weight")
        tensors[name + "_blocks"] = q.data.reshape(e, n, k // 32, 16)
        tensors[name + "_scales"] = q.scale.reshape(e, n, k // 32)
        expected[name] = q.dequantize().transpose(1, 2)
        assert not torch.equal(expected[name], w)  # the codes are not the float weights
    _write(tmp_path, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]})
    model = load_hf(tmp_path)
    params = dict(model.named_parameters())
    for name, values in expected.items():
        assert torch.equal(params[name], values), name
    assert model.config.num_experts == 4 and model.config.attention_sinks


def test_damaged_or_unsupported_quantized_checkpoints_are_refused_in_one_line(fp8_checkpoint):
    path, _ = fp8_checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ModelFileError) as missing:
        load_hf(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelFileError, match="quant_method 'gptq'") as unsupported:
        load_hf(path)
    for e in (missing, unsupported):
        assert "\n" not in str(e.value)
    assert "non-float" in str(missing.value) or "down_proj" in str(missing.value)
