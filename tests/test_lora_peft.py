"""PEFT adapter directories in and out, checked against peft itself (float32, within rounding): an adapter peft
wrote loads into nemo-rz with equal outputs, and one nemo-rz saved loads into peft with equal outputs.
Negative controls: the adapter left out, and an adapter whose settings disagree with lora.*."""
import json

import pytest
import torch

from nemo_rz.models import lora
from nemo_rz.models.hf import load_hf

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
TARGETS = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("peft") / "base"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def _hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(IDS).logits.float(), -1)
    return lp[:, :-1].gather(-1, IDS[:, 1:, None])[..., 0]


def _rz_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return model.token_logprobs(IDS, torch.tensor([12, 12]))


def test_a_peft_adapter_loads_with_equal_outputs(base, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False,
                             use_rslora=True)
    torch.manual_seed(2)
    tuned = peft.get_peft_model(_hf(base), config)
    tuned.save_pretrained(tmp_path / "adapter")
    expect = _hf_logprobs(tuned)
    spec, tensors = lora.load_peft(tmp_path / "adapter")
    assert (spec.rank, spec.alpha, spec.rslora, set(spec.targets)) == (4, 12.0, True, set(TARGETS))
    model = lora.apply_lora(load_hf(base, "float32"), spec)
    plain = _rz_logprobs(model)  # B = 0: the base alone
    lora.init_from(model, tmp_path / "adapter")
    got = _rz_logprobs(model)
    assert (got - expect).abs().max() < 1e-4
    assert (plain - expect).abs().max() > 1e-2  # negative control: without the adapter
    with pytest.raises(ValueError, match="set lora.rank, lora.alpha"):
        lora.init_from(lora.apply_lora(load_hf(base, "float32"), dict(rank=4, alpha=12.0, modules="all")), tmp_path / "adapter")


def test_a_saved_adapter_loads_into_peft_with_equal_outputs(base, tmp_path):
    model = lora.apply_lora(load_hf(base, "float32"), dict(rank=8, alpha=16.0, modules="attention"), seed=3)
    with torch.no_grad():
        for k, v in lora.adapter_state(model).items():
            if "lora_B" in k:
                v.normal_(0, 0.05)
    lora.save_peft(model, tmp_path / "out", base_model=str(base))
    assert json.loads((tmp_path / "out" / lora.CONFIG_FILE).read_text())["target_modules"] == list(lora.ATTENTION)
    loaded = peft.PeftModel.from_pretrained(_hf(base), tmp_path / "out").eval()
    assert (_hf_logprobs(loaded) - _rz_logprobs(model)).abs().max() < 1e-4
    assert (_hf_logprobs(_hf(base)) - _rz_logprobs(model)).abs().max() > 1e-2  # negative control: peft's base alone


def test_unsupported_adapters_are_refused_in_one_line(base, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    peft.get_peft_model(_hf(base), config).save_pretrained(tmp_path / "dora")
    with pytest.raises(ValueError, match="use_dora"):
        lora.load_peft(tmp_path / "dora")
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        lora.load_peft(tmp_path)
