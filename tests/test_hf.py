"""Hugging Face checkpoint I/O: logits parity with transformers, round trips, clear errors, atomic saves."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_rz import atomic, ops
from nemo_rz.models import Decoder, DecoderConfig, ModelFileError, config_from_hf, hf_config, load_hf, save_hf
from nemo_rz.models import hf as hf_io

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
SMALL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
# Families (and variants) of the loader: model_type, config overrides.
KINDS = {
    "qwen3": ("qwen3", dict(head_dim=32, rope_theta=1e6)),
    "qwen2-bias": ("qwen2", dict(rope_theta=5e5)),
    "llama": ("llama", dict(rope_theta=5e5)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-sliding": ("qwen3", dict(head_dim=16, use_sliding_window=True, sliding_window=7, max_window_layers=0)),
}


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Non-trivial values everywhere (norm weights and biases too), so no term is hidden by ones or zeros."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _hf_model(kind: str, seed: int = 0):
    model_type, overrides = KINDS[kind]
    cfg = transformers.AutoConfig.for_model(model_type, **SMALL, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, seed)
    return model.eval()


def _ids(seed: int = 0, batch: int = 3, length: int = 24) -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _nemo_logits(model: Decoder, ids, mode: str) -> torch.Tensor:
    with ops.use_kernels(mode), torch.no_grad():
        return model(ids).float()


def _nemo_model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg.update(overrides)
    model = Decoder(DecoderConfig(**cfg))
    _randomize(model, seed)
    return model.eval()


# -- parity with transformers ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(KINDS))
def test_load_matches_transformers(kind, tmp_path):
    ref = _hf_model(kind)
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    cfg = model.config
    assert cfg.qk_norm == (KINDS[kind][0] == "qwen3")
    assert cfg.attention_bias == (KINDS[kind][0] == "qwen2")
    assert cfg.tie_word_embeddings == (kind == "qwen2-tied") and (model.lm_head is None) == cfg.tie_word_embeddings
    assert cfg.sliding_window == (7 if kind == "qwen3-sliding" else None)
    assert cfg.rope_theta == KINDS[kind][1].get("rope_theta", 10000.0)
    ids = _ids(1, length=24)
    expected = _hf_logits(ref, ids)
    assert expected.std() > 0.5  # logits far from zero, so 1e-4 is a real bound
    for mode in ops.KERNELS:
        got = _nemo_logits(model, ids, mode)
        assert (got - expected).abs().max().item() < TOL, (kind, mode)


def test_negative_control_wrong_rope_theta(tmp_path):
    """The parity bound can fail: a RoPE base that differs from the weights' gives a visible mismatch."""
    ref = _hf_model("qwen3")
    ref.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    model.config.rope_theta = 10000.0  # the checkpoint says 1e6
    diff = (_nemo_logits(model, _ids(2), "consistent") - _hf_logits(ref, _ids(2))).abs().max().item()
    assert diff > 100 * TOL


def test_sharded_checkpoint_and_dtype(tmp_path):
    ref = _hf_model("qwen2-tied", seed=3)
    ref.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    model = load_hf(tmp_path)
    ids = _ids(4)
    assert (_nemo_logits(model, ids, "consistent") - _hf_logits(ref, ids)).abs().max().item() < TOL
    assert all(p.requires_grad for p in model.parameters())  # ready for the learner
    bf16 = load_hf(tmp_path, dtype="bfloat16")
    assert bf16.config.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert load_hf(tmp_path, dtype=torch.bfloat16).config.dtype == "bfloat16"
    with pytest.raises(ValueError, match="float32, bfloat16"):
        load_hf(tmp_path, dtype="float16")


def test_config_from_hf_legacy_format_and_defaults():
    """transformers 4.x configs: top-level rope_theta, torch_dtype, rope_scaling null; keys left to defaults."""
    legacy = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, rope_theta=5e5, rope_scaling=None,
                  torch_dtype="bfloat16")
    cfg = config_from_hf(legacy)
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.dtype) == (4, 16, 5e5, "bfloat16")
    assert (cfg.qk_norm, cfg.attention_bias, cfg.tie_word_embeddings, cfg.max_position_embeddings) == (False, False, False, 2048)
    assert config_from_hf(dict(legacy, torch_dtype="float16")).dtype == "float32"
    assert config_from_hf(legacy, dtype="float32").dtype == "float32"
    # Qwen3: transformers' Qwen3Config defaults head_dim to 128, not hidden_size // heads.
    assert config_from_hf(dict(legacy, architectures=None, model_type="qwen3")).head_dim == 128
    biased = config_from_hf(dict(legacy, attention_bias=True))  # Llama's attention_bias: q/k/v and o_proj biases
    assert (biased.attention_bias, biased.o_proj_bias) == (True, True)
    with pytest.raises(ModelFileError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        config_from_hf(dict(legacy, num_key_value_heads=3))


# -- save_hf round trip ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "architecture, overrides",
    [
        ("Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
        ("Qwen3ForCausalLM", dict(sliding_window=5, tie_word_embeddings=True)),
        ("Qwen2ForCausalLM", dict(qk_norm=False, attention_bias=True, tie_word_embeddings=True)),
        ("LlamaForCausalLM", dict(qk_norm=False, rope_theta=5e5)),
    ],
)
def test_save_hf_round_trip(architecture, overrides, tmp_path):
    model = _nemo_model(5, **overrides)
    save_hf(model, tmp_path / "ckpt", architecture)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary directories left behind
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", attn_implementation="eager").eval()
    assert type(ref).__name__ == architecture
    ids = _ids(6)
    expected = _hf_logits(ref, ids)
    assert (_nemo_logits(model, ids, "consistent") - expected).abs().max().item() < TOL
    again = load_hf(tmp_path / "ckpt")
    assert again.config == model.config
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_hf_config_refuses_what_the_architecture_cannot_express():
    with pytest.raises(ValueError, match="qk_norm=False.*save it as Qwen2ForCausalLM"):
        hf_config(DecoderConfig(qk_norm=False, attention_bias=True), "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match="qk_norm=True.*save it as Qwen3ForCausalLM"):
        hf_config(DecoderConfig(), "MistralForCausalLM")
    with pytest.raises(ValueError, match="LlamaForCausalLM cannot express.*MistralForCausalLM"):
        hf_config(DecoderConfig(qk_norm=False, sliding_window=8), "LlamaForCausalLM")
    with pytest.raises(ValueError, match="unsupported architecture 'PhiForCausalLM'"):
        hf_config(DecoderConfig(), "PhiForCausalLM")


# -- clear errors ------------------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    save_hf(_nemo_model(7), path)
    return path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _nonfinite(t):
    t["model.layers.1.mlp.up_proj.weight"][3, 4] = float("nan")


def _shard_missing(path):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model.safetensors").unlink()


BREAKAGES = {
    "missing directory": (lambda p: p.rename(p.with_name("elsewhere")), ["does not exist"]),
    "file not directory": (lambda p: (os.rename(p, p.with_name("x")), p.write_text("hi")), ["is a file"]),
    "missing config.json": (lambda p: (p / "config.json").unlink(), ["no config.json"]),
    "unparsable config.json": (lambda p: (p / "config.json").write_text('{"vocab_size": 64,'), ["cannot parse", "line 1"]),
    "unsupported architecture": (
        lambda p: _edit_config(p, architectures=["PhiForCausalLM"]),
        ["'PhiForCausalLM'", "Qwen3ForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM"],
    ),
    "missing key": (lambda p: _edit_config(p, hidden_size=None), ["'hidden_size'"]),
    "rope scaling": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}),
        ["'longrope'", "default, linear, llama3, yarn"],
    ),
    "legacy rope scaling": (
        lambda p: _edit_config(p, rope_scaling={"type": "dynamic", "factor": 2.0}), ["'dynamic'"]
    ),
    "rope scaling without its keys": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4,
                                                   "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
        ["high_freq_factor"],
    ),
    "different sliding layers": (
        lambda p: _edit_config(p, use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
        ["'layer_types'", "one of full_attention, sliding_attention per layer (2)"],
    ),
    "missing safetensors": (lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin"),
                            ["no model.safetensors", "pytorch_model.bin"]),
    "missing shard": (_shard_missing, ["model-00001-of-00002.safetensors", "missing"]),
    "truncated safetensors": (
        lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
        ["cannot read", "corrupt or truncated"],
    ),
    "missing tensors": (
        lambda p: _edit_tensors(p, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")
                                              and not k.endswith("input_layernorm.weight")]),
        ["10 tensor(s) missing", "model.layers.1.", "(+7 more)"],
    ),
    "missing layer": (
        lambda p: _edit_tensors(p, lambda t: [t.pop(k) for k in list(t) if k.startswith("model.layers.1.")]),
        ["num_hidden_layers=2 in", "config.json is more than the weights hold", "tensors of 1 layer(s) (model.layers.0 to "
         "model.layers.0)"],
    ),
    "layers beyond the tensors": (  # refused from the tensor names, before a 10^8-layer model is built
        lambda p: _edit_config(p, num_hidden_layers=100_000_000),
        ["num_hidden_layers=100000000 in", "tensors of 2 layer(s) (model.layers.0 to model.layers.1)", "fix config.json"],
    ),
    "layers beyond the tensors, sliding": (  # config_from_hf's per-layer lists are not built either
        lambda p: _edit_config(p, num_hidden_layers=10**15, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        ["num_hidden_layers=1000000000000000 in"],
    ),
    "no layer tensors": (
        lambda p: _edit_tensors(p, lambda t: [t.update({k.replace("model.layers.", "model.blocks."): t.pop(k)})
                                              for k in list(t) if k.startswith("model.layers.")]),
        ["num_hidden_layers=2 in", "has no model.layers.N tensors"],
    ),
    "extra tensors": (
        lambda p: _edit_tensors(p, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2, 2)})),
        ["unexpected tensor", "model.layers.2.mlp.up_proj.weight"],
    ),
    "mis-shaped tensor": (
        lambda p: _edit_config(p, intermediate_size=96), ["wrong shape", "mlp.gate_proj.weight is [128, 64] not [96, 64]"]
    ),
    "non-finite weights": (lambda p: _edit_tensors(p, _nonfinite), ["NaN", "model.layers.1.mlp.up_proj.weight"]),
}


@pytest.mark.parametrize("case", list(BREAKAGES))
def test_bad_files_raise_one_clear_line(case, ckpt):
    breakage, fragments = BREAKAGES[case]
    breakage(ckpt)
    with pytest.raises(ModelFileError) as info:
        load_hf(ckpt)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "\n" not in message and ";" in message  # what/where; what to do
    assert str(ckpt) in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("moe_kind, key", [("qwen3", "num_experts"), ("gpt_oss", "num_local_experts")])
def test_expert_count_beyond_the_tensors_is_refused_before_building(moe_kind, key, tmp_path):
    """A MoE config.json asking for 10^8 experts is refused from the tensor shapes (the router's rows, the
    stacked or per-expert weights) in one line, before the model (or the per-expert name list) is built."""
    extra = dict(attention_sinks=True, norm="rms_f32", qk_norm=False, attention_bias=True, o_proj_bias=True,
                 sliding_window=8, layer_types=["sliding_attention", "full_attention"]) if moe_kind == "gpt_oss" else {}
    model = _nemo_model(3, num_experts=4, num_experts_per_tok=2, intermediate_size=32, moe_intermediate_size=32,
                        moe_kind=moe_kind, **extra)
    path = save_hf(model, tmp_path / "ckpt")
    assert load_hf(path).config.num_experts == 4
    _edit_config(path, **{key: 100_000_000})
    with pytest.raises(ModelFileError) as info:
        load_hf(path)
    message = str(info.value)
    assert f"{key}=100000000 in {path / 'config.json'} is more than the weights hold" in message
    assert "tensors of 4 expert(s) per layer" in message and "\n" not in message


def test_oversized_json_is_refused_before_reading(ckpt, monkeypatch):
    monkeypatch.setattr(hf_io, "JSON_MAX_BYTES", 100)
    with pytest.raises(ModelFileError, match=r"config.json is \d+ bytes, more than the 100 a checkpoint's JSON file"):
        load_hf(ckpt)


def test_tied_checkpoint_with_redundant_head_and_old_rope_buffers(ckpt):
    """Files transformers accepts (lm_head of a tied model, rotary inv_freq buffers) load too."""
    _edit_config(ckpt, tie_word_embeddings=True)

    def add(t):
        t["lm_head.weight"] = t.pop("lm_head.weight")
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    _edit_tensors(ckpt, add)
    model = load_hf(ckpt)
    assert model.lm_head is None


# -- atomic saves ------------------------------------------------------------------------------------------
def _snapshot(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_interrupted_save_keeps_existing_checkpoint(exchange, tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    old = _nemo_model(8)
    save_hf(old, path)
    (path / "tokenizer.json").write_text("{}")
    before = _snapshot(path)
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)

    def half_written(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_io, "save_file", half_written)
    with pytest.raises(OSError, match="No space left"):
        save_hf(_nemo_model(9), path)
    assert _snapshot(path) == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    with pytest.raises(OSError):
        save_hf(_nemo_model(9), tmp_path / "new")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    loaded = load_hf(path)
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), loaded.state_dict().values()))

    monkeypatch.undo()
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    (path / "model-00001-of-00002.safetensors").write_bytes(b"stale shard")
    new = _nemo_model(9)
    save_hf(new, path)  # a successful overwrite: new weights, tokenizer kept, stale weight files gone
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    loaded = load_hf(path)
    assert all(torch.equal(a, b) for a, b in zip(new.state_dict().values(), loaded.state_dict().values()))


def test_models_package_does_not_import_transformers():
    code = "import sys, nemo_rz.models; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
