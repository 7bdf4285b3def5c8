"""Check nemo-rz's consistent layer spec the way NeMo RL's Megatron policy runs it, before a long job: a GPTModel
built as Megatron-Bridge's GPTModelProvider.provide builds it, with `transformer_layer_spec=consistent_layer_spec`
(nemo_rz/runtime/megatron/bridge.py), fed NeMo RL's two layouts (dense [b, s] with a causal mask, and sequence
packing: one [1, T] row with thd PackedSeqParams), against nemo-rz's own model (the one its vLLM plugin runs) on
the same tokens and weights. It prints, of the predicted tokens, how many logprobs differ from nemo-rz's:

- `consistent spec + output hook`: the model's logits through ops.token_logprobs, with the output layer replaced by
  `consistent_output_layer` (what NeMo RL's Megatron setup applies once bridge.py is imported there), and through
  the loss's own nemo_rl_policy.VocabParallelLogprobs (what the loss computes with reinforce_zero.logprobs:
  consistent): 0 is the contract;
- `consistent spec, stock output layer`: the same without the hook (what NeMo RL builds: Megatron's
  ColumnParallelLinear as the output layer);
- `... + NeMo RL's log-softmax`: those logits through NeMo RL's own logprob recipe at TP=1 (float32 logits, max
  subtracted, exp-sum, log: nemo_rl/distributed/model_utils.py, DistributedLogprob), what NeMo RL's Megatron
  policy hands the loss: the mismatch the importance weights still see inside NeMo RL;
- `Megatron's local spec + NeMo RL's log-softmax`: the baseline without nemo-rz's spec, Megatron's own local layers
  (its linears, torch RMSNorm, DotProductAttention; RoPE through ops.rope, as Megatron's rotary table needs CUDA)
  and NeMo RL's log-softmax, dense layout (Megatron's local attention takes no thd batch). NeMo RL's stock spec is
  Transformer Engine's, which needs CUDA; where it runs, its mismatch is what NeMo RL's token_mult_prob_error shows.

    python examples/nemo_rl/check_megatron.py /path/to/hf_checkpoint [--dtype bfloat16]

The provider comes from Megatron-Bridge's AutoBridge where Megatron-Bridge imports (NeMo RL's `--extra mcore`
environment, on a GPU node); elsewhere (megatron-core only) from the checkpoint's config.json by Megatron-Bridge's
CONFIG_MAPPING and its Llama / Qwen2 / Qwen3 bridges' settings (`ProviderShape`, GPTModelProvider's own fields).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Optional

PROG = "check_megatron"

# megatron/bridge/models/conversion/model_bridge.py (0.3.1), MegatronModelBridge.CONFIG_MAPPING: the dense entries
CONFIG_MAPPING = [("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size"),
                  ("intermediate_size", "ffn_hidden_size"), ("num_attention_heads", "num_attention_heads"),
                  ("num_key_value_heads", "num_query_groups"), ("head_dim", "kv_channels"),
                  ("vocab_size", "vocab_size"), ("max_position_embeddings", "seq_length"),
                  ("rms_norm_eps", "layernorm_epsilon"), ("tie_word_embeddings", "share_embeddings_and_output_weights"),
                  ("attention_bias", "add_qkv_bias"), ("mlp_bias", "add_bias_linear"), ("rope_theta", "rotary_base")]
# the provider settings each family's bridge sets (llama_bridge.py, qwen2_bridge.py, qwen3_bridge.py, 0.3.1)
FAMILIES = {"llama": {}, "qwen2": {"add_qkv_bias": True}, "qwen3": {"add_qkv_bias": False, "qk_layernorm": True}}


@functools.cache
def provider_shape():
    """GPTModelProvider's own fields (megatron/bridge/models/gpt_provider.py, 0.3.1) over megatron-core's
    TransformerConfig, with the provider's defaults."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    @dataclasses.dataclass
    class ProviderShape(TransformerConfig):
        vocab_size: Optional[int] = None
        rotary_base: int = 10000
        rotary_percent: float = 1.0
        rope_scaling: bool = False
        seq_length: int = 1024
        attention_softmax_in_fp32: bool = False
        share_embeddings_and_output_weights: bool = True
        position_embedding_type: str = "learned_absolute"
        parallel_output: bool = True

    return ProviderShape


def provider_from_hf(hf: dict, **overrides):
    """What AutoBridge.to_megatron_provider gives for a Llama / Qwen2 / Qwen3 Hugging Face config (RMSNorm, gated
    silu MLP, RoPE, the family's biases and qk-norm), on CPU initialisation and without RoPE fusion."""
    import torch
    import torch.nn.functional as F

    family = hf.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"model_type {family!r}: this check builds {', '.join(FAMILIES)} checkpoints")
    kw = {meg: hf[name] for name, meg in CONFIG_MAPPING if hf.get(name) is not None}
    kw.setdefault("kv_channels", hf["hidden_size"] // hf["num_attention_heads"])
    kw.setdefault("add_bias_linear", False)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    kw.update(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
              attention_dropout=0.0, bias_activation_fusion=True, masked_softmax_fusion=True, persist_layer_norm=True,
              bias_dropout_fusion=True, apply_rope_fusion=False, position_embedding_type="rope",
              params_dtype=getattr(torch, dtype), use_cpu_initialization=True, **FAMILIES[family])
    kw.update(overrides)
    return provider_shape()(**kw)


def build(provider, layer_spec, decoder):
    """GPTModelProvider.provide's GPTModel (its arguments; one pipeline stage) holding `decoder`'s weights."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    gpt = GPTModel(provider, transformer_layer_spec=layer_spec, vocab_size=provider.vocab_size,
                   max_sequence_length=provider.seq_length, parallel_output=provider.parallel_output,
                   share_embeddings_and_output_weights=provider.share_embeddings_and_output_weights,
                   position_embedding_type=provider.position_embedding_type, rotary_base=provider.rotary_base,
                   rotary_percent=provider.rotary_percent, pre_process=True, post_process=True)
    return load(gpt, decoder).to(next(decoder.parameters()).device)


def load(gpt, decoder):
    """`decoder`'s (Hugging Face-named) weights into a GPTModel of the consistent spec."""
    import torch

    from nemo_rz.runtime.megatron import convert

    weights = convert.to_megatron(decoder.state_dict(), decoder.config)
    params = dict(gpt.named_parameters())
    if set(params) != set(weights):
        raise ValueError(f"the GPTModel's parameters and the checkpoint's differ: {sorted(set(params) ^ set(weights))[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return gpt.eval()


def nemo_rz_logprobs(logits, ids):
    """nemo-rz's logprob of each next token from [b, s, vocab] logits (ops.token_logprobs: the rollout side's)."""
    from nemo_rz import ops

    b, s, v = logits.shape
    return ops.token_logprobs(logits[:, :-1].reshape(-1, v), ids[:, 1:].reshape(-1), 1.0).view(b, s - 1)


def nemo_rl_logprobs(logits, ids):
    """NeMo RL's Megatron logprobs at TP=1 (nemo_rl/distributed/model_utils.py, DistributedLogprob.forward and
    _compute_distributed_log_softmax_with_grad): float32 logits, max subtracted, exp-sum, log, gathered."""
    x = logits[:, :-1].float()
    x = x - x.amax(-1, keepdim=True)
    lp = x - x.exp().sum(-1, keepdim=True).float().log()
    return lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def dense(gpt, ids, to_logprobs=nemo_rz_logprobs):
    """NeMo RL's forward without sequence packing: [b, s] ids, positions, its causal mask, no packed_seq_params."""
    import torch

    b, s = ids.shape
    mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)[None, None]
    return to_logprobs(gpt(ids, torch.arange(s, device=ids.device).expand(b, s), mask), ids)


def packed(gpt, ids, lengths, multiple: int = 8, params: bool = True, to_logprobs=nemo_rz_logprobs):
    """NeMo RL's sequence packing (nemo_rl/models/megatron/data.py): each sequence padded to a multiple, all in one
    [1, T] row, PackedSeqParams(qkv_format="thd", cu_seqlens_* = the padded boundaries); [b, s-1] logprobs.
    params=False: the row read as one sequence (what a forward blind to the boundaries computes)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.packed_seq_params import PackedSeqParams

    dev = ids.device
    padded = [-(-int(n) // multiple) * multiple for n in lengths]
    row = torch.cat([F.pad(ids[i, :n], (0, p - int(n))) for i, (n, p) in enumerate(zip(lengths, padded))])[None]
    cu = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    if params:
        p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                            cu_seqlens_kv_padded=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
        logits = gpt(row, None, None, packed_seq_params=p)
    else:
        t = row.shape[1]
        logits = gpt(row, torch.arange(t, device=dev)[None],
                     torch.ones(t, t, dtype=torch.bool, device=dev).triu(1)[None, None])
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=dev)
    for i, n in enumerate(lengths.tolist()):
        start = int(cu[i])
        out[i, : n - 1] = to_logprobs(logits[:, start:start + n], row[:, start:start + n])[0]
    return out


def local_spec_dense(provider, decoder, ids, to_logprobs=nemo_rl_logprobs):
    """The baseline: Megatron's local layers (spec.block_spec fast) with decoder's weights, dense layout."""
    import torch

    from nemo_rz.models.decoder import Tokens, prepared
    from nemo_rz.runtime.megatron import layers, spec

    local = dataclasses.replace(provider, persist_layer_norm=False, position_embedding_type="none")
    gpt = build(local, spec.block_spec(decoder.config, fast=True), decoder)
    b, s = ids.shape
    dev = ids.device
    t = Tokens(torch.zeros(0, dtype=torch.long, device=dev), torch.arange(s, device=dev).repeat(b),
               torch.arange(b, device=dev).repeat_interleave(s), None, (b, s))
    params = layers.TokenParams(tokens=prepared(decoder.config, t))  # the forward's tokens, for ops.rope
    mask = torch.ones(s, s, dtype=torch.bool, device=dev).triu(1)[None, None]
    return to_logprobs(gpt(ids, torch.arange(s, device=dev).expand(b, s), mask, packed_seq_params=params), ids)


def provider_for(path: Path, dtype: str):
    """(provider, where it came from): Megatron-Bridge's AutoBridge if it imports, else provider_from_hf."""
    import torch

    try:
        from megatron.bridge import AutoBridge
    except ImportError as e:
        hf = json.loads((path / "config.json").read_text())
        return provider_from_hf(hf, params_dtype=getattr(torch, dtype)), f"config.json (no Megatron-Bridge: {e})"
    provider = AutoBridge.from_hf_pretrained(str(path)).to_megatron_provider(load_weights=False)
    provider.params_dtype = getattr(torch, dtype)
    provider.apply_rope_fusion = False
    return provider, f"Megatron-Bridge {type(provider).__name__}"


def check(path: Path, dtype: str, provider, rows: int, length: int, seed: int = 0) -> dict[str, tuple[int, int, float]]:
    """{what: (differing, compared, largest difference)} over `rows` random sequences of up to `length` tokens."""
    import torch

    from nemo_rz import ops
    from nemo_rz.models.hf import load_hf
    from nemo_rz.runtime.megatron import bridge
    from nemo_rz.runtime.megatron.nemo_rl_policy import VocabParallelLogprobs

    ops.set_kernels("consistent")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    decoder = load_hf(path, dtype).to(device).eval()
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    lengths[0] = length
    ids = torch.randint(0, decoder.config.vocab_size, (rows, length), generator=g).to(device)
    ok = (torch.arange(length - 1)[None, :] < (lengths[:, None] - 1)).to(device)
    out = {}
    with torch.no_grad():
        want = decoder.token_logprobs(ids, lengths.to(device))
        gpt = build(provider, bridge.consistent_layer_spec(provider), decoder)
        for name, lp in (("consistent spec, stock output layer, dense", dense(gpt, ids)),
                         ("consistent spec, stock output layer, packed", packed(gpt, ids, lengths)),
                         ("... + NeMo RL's log-softmax, packed", packed(gpt, ids, lengths, to_logprobs=nemo_rl_logprobs))):
            out[name] = (int((lp[ok] != want[ok]).sum()), int(ok.sum()), float((lp[ok] - want[ok]).abs().max()))
        lp = local_spec_dense(provider, decoder, ids)
        out["Megatron's local spec + NeMo RL's log-softmax, dense"] = (
            int((lp[ok] != want[ok]).sum()), int(ok.sum()), float((lp[ok] - want[ok]).abs().max()))
        bridge.consistent_output_layer([gpt])
        head = VocabParallelLogprobs(decoder.config.vocab_size)  # the loss's, with reinforce_zero.logprobs: consistent
        for name, lp in (("consistent spec + output hook, dense", dense(gpt, ids)),
                         ("consistent spec + output hook, packed", packed(gpt, ids, lengths)),
                         ("consistent spec + output hook + the loss's VocabParallelLogprobs, packed",
                          packed(gpt, ids, lengths, to_logprobs=head))):
            out[name] = (int((lp[ok] != want[ok]).sum()), int(ok.sum()), float((lp[ok] - want[ok]).abs().max()))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="Hugging Face checkpoint folder (policy.model_name)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="policy.precision")
    parser.add_argument("--rows", type=int, default=4, help="sequences in the batch")
    parser.add_argument("--length", type=int, default=48, help="longest sequence's tokens")
    args = parser.parse_args(argv)
    try:
        from megatron.core import parallel_state  # noqa: F401

        from nemo_rz.runtime.megatron import distributed
        from nemo_rz.runtime.megatron.layout import Layout
    except ImportError as e:
        print(f"{PROG}: megatron-core is not importable here ({e}); run it where NeMo RL's Megatron policy runs "
              "(uv run --extra mcore) or install nemo-rz's megatron extra", file=sys.stderr)
        return 2
    distributed.init(Layout())
    provider, source = provider_for(args.checkpoint, args.dtype)
    print(f"provider: {source}; {args.rows} sequences of up to {args.length} tokens, {args.dtype}")
    for what, (diff, n, worst) in check(args.checkpoint, args.dtype, provider, args.rows, args.length).items():
        print(f"{what}: {diff} of {n} logprobs differ from nemo-rz's model (largest difference {worst:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
