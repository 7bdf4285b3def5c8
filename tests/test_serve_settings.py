"""`python -m nemo_rz.tools.serve` composes a run's `precision.*` into the engine settings the vLLM rollout backend
uses (hf_overrides.nemo_rz_precision), so a quantized policy is served with the learner's quantized linears; bad
precision names, `--lora` and vLLM's own `--enable-lora` are refused in one line. No server is started: the
settings are read from `--print` (tests/test_vllm_serve.py, slow tier, runs the server itself)."""
from __future__ import annotations

import json
import shlex

import pytest
import torch

from nemo_rz.models import Decoder
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.hf import save_hf
from nemo_rz.quant.apply import apply_precision
from nemo_rz.quant.linear import Precision, QuantizedLinear
from nemo_rz.tools import serve

CFG = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
           head_dim=32, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(**CFG))
    return model, save_hf(model, tmp_path_factory.mktemp("serve_settings") / "hf")


def _overrides(capsys, argv) -> dict:
    assert serve.main([*argv, "--print"]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    return json.loads(words[words.index("--hf-overrides") + 1])


def _quantized(model, precision) -> int:
    return sum(isinstance(m, QuantizedLinear) for m in apply_precision(model, precision).modules())


def test_precision_reaches_the_models_hf_overrides(checkpoint, capsys):
    model, ckpt = checkpoint
    served = _overrides(capsys, [str(ckpt), "--precision", "fp8_block", "--precision-modules", "mlp"])
    want = Precision("fp8_block", "mlp").as_dict()
    assert served["nemo_rz_precision"] == want
    from nemo_rz.generation.vllm.backend import _checked_precision  # the rollout backend's mapping is the same
    assert _checked_precision({"recipe": "fp8_block", "modules": "mlp"}) == want
    # what NemoRZForCausalLM does with it (model.py: apply_precision on its Decoder): the MLP's three linears quantized
    assert _quantized(Decoder(model.config), served["nemo_rz_precision"]) == 3
    # negative control: without --precision the model is served unquantized
    plain = _overrides(capsys, [str(ckpt)])
    assert plain["nemo_rz_precision"] is None and _quantized(Decoder(model.config), plain["nemo_rz_precision"]) == 0
    assert {k: v for k, v in served.items() if k != "nemo_rz_precision"} == {k: v for k, v in plain.items()
                                                                              if k != "nemo_rz_precision"}


@pytest.mark.parametrize("argv, needle", [
    (["--precision", "fp9"], "--precision: precision.recipe='fp9': use one of none, bf16, fp8_current"),
    (["--precision", "fp8_delayed"], "delayed scaling"),
    (["--precision", "mxfp8", "--precision-modules", "head"], "precision.modules='head': use one of"),
    (["--precision", "mxfp8", "--precision-activation-scaling", "col"], "precision.activation_scaling='col'"),
    (["--lora", "exported/lora"], "--lora is not supported: hf_overrides carry the adapters' spec but not their weights"),
    (["--enable-lora"], "--enable-lora is not allowed: vLLM's own LoRA runs its own kernels"),
])
def test_bad_precision_and_lora_are_refused_in_one_line(checkpoint, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        serve.main([str(checkpoint[1]), *argv, "--print"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, (argv, err)
