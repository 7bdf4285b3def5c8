"""nemo-rz's consistent layer spec inside a GPTModel built the way Megatron-Bridge's providers (and so NeMo RL's
Megatron policy) build it (nemo_rz/runtime/megatron/bridge.py).

Megatron-Bridge itself is used where it imports. Its 0.3.x wheels (the ones PyPI offers for Python 3.11) require
megatron-core >=0.15,<0.17 (0.16.1 here fits) but also transformers<5 and transformer-engine (CUDA), and the
package imports transformer_engine at import (megatron/bridge/peft/lora_layers.py), so on a CPU machine with
transformers 5 it does not import; the test against it then skips with that reason, and the others build the
provider's shape themselves: a TransformerConfig with GPTModelProvider's own fields (`Provider` below, field names
as megatron/bridge/models/gpt_provider.py 0.3.1 spells them), filled from a Hugging Face config by the Bridge's
CONFIG_MAPPING and its Llama / Qwen3 bridges' settings, and a GPTModel built with the arguments
GPTModelProvider.provide passes.
"""
import dataclasses
import json
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from conftest import tiny_model  # noqa: E402
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models.decoder import Tokens, prepared  # noqa: E402
from nemo_rz.models.hf_config import config_from_hf  # noqa: E402
from nemo_rz.runtime.megatron import bridge, convert, distributed, layers, spec  # noqa: E402
from nemo_rz.runtime.megatron.layout import Layout  # noqa: E402

SMOLLM2 = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct" / "config.json"


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    distributed.init(Layout())
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@dataclasses.dataclass
class Provider(TransformerConfig):
    """GPTModelProvider's own fields (megatron/bridge/models/gpt_provider.py, 0.3.1) with its defaults."""

    vocab_size: Optional[int] = None
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    rope_scaling: bool = False
    seq_length: int = 1024
    share_embeddings_and_output_weights: bool = True
    position_embedding_type: str = "learned_absolute"
    parallel_output: bool = True


# megatron/bridge/models/conversion/model_bridge.py, MegatronModelBridge.CONFIG_MAPPING (dense entries)
CONFIG_MAPPING = [("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                  ("intermediate_size", "ffn_hidden_size"), ("num_attention_heads", "num_attention_heads"),
                  ("num_key_value_heads", "num_query_groups"), ("head_dim", "kv_channels"),
                  ("vocab_size", "vocab_size"), ("max_position_embeddings", "seq_length"),
                  ("rms_norm_eps", "layernorm_epsilon"), ("tie_word_embeddings", "share_embeddings_and_output_weights"),
                  ("attention_bias", "add_qkv_bias"), ("mlp_bias", "add_bias_linear"), ("rope_theta", "rotary_base")]


def provider_from_hf(hf: dict, **overrides) -> Provider:
    """What AutoBridge.to_megatron_provider gives for a Llama / Qwen3 checkpoint (llama_bridge.py, qwen3_bridge.py:
    RMSNorm, gated silu MLP, no linear biases, qk-layernorm for Qwen3), with the override that selects the
    consistent spec (position_embedding_type none) and this machine's settings (CPU init, no rope fusion)."""
    kw = {meg: hf[name] for name, meg in CONFIG_MAPPING if hf.get(name) is not None}
    kw.setdefault("kv_channels", hf["hidden_size"] // hf["num_attention_heads"])
    kw.setdefault("add_bias_linear", False)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[hf.get("dtype") or hf.get("torch_dtype") or "float32"]
    kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
              attention_dropout=0.0, qk_layernorm=hf.get("model_type") == "qwen3", bias_activation_fusion=True,
              masked_softmax_fusion=True, persist_layer_norm=True, bias_dropout_fusion=True, apply_rope_fusion=False,
              position_embedding_type="none", params_dtype=dtype, use_cpu_initialization=True)
    kw.update(overrides)
    return Provider(**kw)


def hf_config(model) -> dict:
    cfg = model.config
    return {"model_type": "qwen3" if cfg.qk_norm else "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias, "mlp_bias": False, "rope_theta": cfg.rope_theta, "dtype": cfg.dtype}


def provided(config: Provider, layer_spec, model) -> GPTModel:
    """GPTModelProvider.provide's GPTModel (its arguments, one pipeline stage) with `model`'s weights."""
    gpt = GPTModel(config, transformer_layer_spec=layer_spec, vocab_size=config.vocab_size,
                   max_sequence_length=config.seq_length, parallel_output=config.parallel_output,
                   share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
                   position_embedding_type=config.position_embedding_type, rotary_base=config.rotary_base,
                   rotary_percent=config.rotary_percent, pre_process=True, post_process=True)
    return load(gpt, model)


def load(gpt, model):
    weights = convert.to_megatron(model.state_dict(), model.config)
    params = dict(gpt.named_parameters())
    assert set(params) == set(weights)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return gpt.eval()


def batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([13, 6, 11])
    return torch.randint(0, vocab, (3, 13), generator=g), lengths


def logprobs(logits, ids):
    """nemo-rz's logprob of each next token from [b, s, vocab] logits (the rollout side's ops.token_logprobs)."""
    b, s, v = logits.shape
    return ops.token_logprobs(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), 1.0).view(b, s - 1)


def dense(gpt, ids):
    """NeMo RL's forward without sequence packing: [b, s] ids, positions, its causal mask, no packed_seq_params."""
    b, s = ids.shape
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    return logprobs(gpt(ids, torch.arange(s).expand(b, s), mask), ids)


def packed(gpt, ids, lengths, multiple: int = 8, params: bool = True):
    """NeMo RL's sequence packing (nemo_rl/models/megatron/data.py): each sequence padded to a multiple, all in
    one [1, T] row, PackedSeqParams(qkv_format="thd", cu_seqlens_*=padded boundaries); per-sequence logprobs."""
    padded = [-(-int(n) // multiple) * multiple for n in lengths]
    row = torch.cat([F.pad(ids[i, :n], (0, p - int(n))) for i, (n, p) in enumerate(zip(lengths, padded))])[None]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    if params:
        p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                            cu_seqlens_kv_padded=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
        logits = gpt(row, None, None, packed_seq_params=p)
    else:  # the whole row as one sequence (what a forward that ignores the boundaries computes)
        t = row.shape[1]
        logits = gpt(row, torch.arange(t)[None], torch.ones(t, t, dtype=torch.bool).triu(1)[None, None])
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, n in enumerate(lengths.tolist()):
        start = int(cu[i])
        out[i, : n - 1] = logprobs(logits[:, start:start + n], row[:, start:start + n])[0]
    return out


def valid(lengths, width):
    return torch.arange(width)[None, :] < (lengths[:, None] - 1)


def test_provider_fields_map_to_the_checkpoints_decoder_config():
    """The real SmolLM2 checkpoint's config through the Bridge's mapping gives the DecoderConfig nemo-rz's loader
    (and so its vLLM model) reads from that config."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is not here (the converted checkpoint is gitignored)")
    hf = json.loads(SMOLLM2.read_text())
    assert bridge.decoder_config(provider_from_hf(hf)) == config_from_hf(hf)
    assert bridge.decoder_config(provider_from_hf(hf, qk_layernorm=True)) != config_from_hf(hf)  # the map is read


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_gptmodel_from_the_spec_callable_equals_the_decoder_bit_for_bit(qk_norm):
    """Dense and thd-packed forwards of a GPTModel built from consistent_layer_spec(provider) (plus the output-layer
    hook) give the built-in Decoder's logprobs bit for bit. Negative controls: the stock local spec, and the packed
    row read as one sequence (the sequence boundaries ignored)."""
    model = tiny_model(3, vocab_size=61, qk_norm=qk_norm, num_layers=3, tie_word_embeddings=not qk_norm)
    config = provider_from_hf(hf_config(model))
    assert bridge.decoder_config(config) == model.config
    ids, lengths = batch(61)
    ok = valid(lengths, ids.shape[1] - 1)
    with torch.no_grad():
        want = model.token_logprobs(ids, lengths)
        gpt = provided(config, bridge.consistent_layer_spec(config), model)
        bridge.consistent_output_layer([gpt])
        assert isinstance(gpt.output_layer, layers.ColumnLinear)
        assert torch.equal(dense(gpt, ids)[ok], want[ok])
        assert torch.equal(packed(gpt, ids, lengths)[ok], want[ok])
        assert torch.equal(packed(gpt, ids, lengths, multiple=1)[ok], want[ok])  # no padding between sequences
        merged = packed(gpt, ids, lengths, params=False)
        assert not torch.equal(merged[ok], want[ok])
        assert torch.equal(merged[0, :12], want[0, :12])  # the first sequence alone is unaffected

        # Megatron's local layers (their torch norm refuses the Llama provider's persist_layer_norm without Apex)
        local = dataclasses.replace(config, persist_layer_norm=False)
        stock = provided(local, spec.block_spec(model.config, fast=True), model)
        t = Tokens(torch.zeros(0, dtype=torch.long), torch.arange(13).repeat(3), torch.arange(3).repeat_interleave(13),
                   None, (3, 13))
        params = layers.TokenParams(tokens=prepared(model.config, t))  # the forward's tokens, for its RoPE
        mask = torch.ones(13, 13, dtype=torch.bool).triu(1)[None, None]
        lp = logprobs(stock(ids, torch.arange(13).expand(3, 13), mask, packed_seq_params=params), ids)
        assert not torch.equal(lp[ok], want[ok])
        assert (lp[ok] - want[ok]).abs().max() < 1e-3  # the same model, other arithmetic


def test_the_spec_refuses_what_it_does_not_build_in_one_line():
    model = tiny_model(0, vocab_size=61)
    hf = hf_config(model)
    for overrides, words in [
        ({"position_embedding_type": "rope"}, "model_overrides.position_embedding_type: none"),
        ({"sequence_parallel": True, "tensor_model_parallel_size": 2}, "sequence_parallel"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"activation_func": F.gelu}, "activation_func"),
        ({"window_size": (4, 0)}, "window_size"),
        ({"vocab_size": None}, "vocab_size"),
    ]:
        with pytest.raises(ValueError) as e:
            bridge.consistent_layer_spec(provider_from_hf(hf, **overrides))
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="has no position_embedding_type"):  # a plain TransformerConfig lacks the provider's fields
        bridge.decoder_config(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4))
    with pytest.raises(ValueError, match="vp_stage"):
        bridge.consistent_layer_spec(provider_from_hf(hf), vp_stage=1)
    p = core_attention(model.config)
    with pytest.raises(ValueError, match="do not cover"):
        p.forward(*(torch.zeros(10, h, 16) for h in (4, 2, 2)), None,
                  packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 8])))


def core_attention(cfg):
    """One layer's PackedCoreAttention, built as Megatron's SelfAttention builds its core attention."""
    from megatron.core.transformer.enums import AttnMaskType

    config = provider_from_hf(hf_config(tiny_model(0, vocab_size=61)))
    return bridge.PackedCoreAttention(config, 1, AttnMaskType.causal, "self", model_config=cfg, shared={})


def test_resolve_layer_spec_takes_the_config_string():
    assert bridge.resolve_layer_spec(bridge.SPEC_PATH) is bridge.consistent_layer_spec
    assert bridge.resolve_layer_spec("nemo_rz.runtime.megatron.bridge.consistent_layer_spec") is bridge.consistent_layer_spec
    assert bridge.resolve_layer_spec(bridge.consistent_layer_spec) is bridge.consistent_layer_spec
    with pytest.raises(ValueError, match="cannot import"):
        bridge.resolve_layer_spec("nemo_rz.runtime.megatron.bridge:no_such_spec")
    with pytest.raises(ValueError, match="spec\\(config\\)"):
        bridge.resolve_layer_spec("nemo_rz.runtime.megatron.bridge:_with_packed_attention")


def test_megatron_bridge_gpt_provider_builds_the_consistent_model():
    """Megatron-Bridge's own GPTModelProvider.provide with transformer_layer_spec = consistent_layer_spec."""
    try:
        from megatron.bridge.models.gpt_provider import GPTModelProvider
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError as e:
        import transformers

        pytest.skip(f"megatron-bridge does not import here ({e}); 0.3.x needs transformer-engine (CUDA) at import "
                    f"and transformers<5 (installed: {transformers.__version__})")
    model = tiny_model(3, vocab_size=61, qk_norm=True, num_layers=3)
    shape = dataclasses.asdict(provider_from_hf(hf_config(model)))
    fields = {f.name for f in dataclasses.fields(GPTModelProvider) if f.init}
    provider = GPTModelProvider(**{k: v for k, v in shape.items() if k in fields},
                                transformer_layer_spec=bridge.consistent_layer_spec)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    gpt = load(provider.provide(pre_process=True, post_process=True), model)
    bridge.consistent_output_layer([gpt])
    ids, lengths = batch(61)
    ok = valid(lengths, ids.shape[1] - 1)
    with torch.no_grad():
        want = model.token_logprobs(ids, lengths)
        assert torch.equal(packed(gpt, ids, lengths)[ok], want[ok])
