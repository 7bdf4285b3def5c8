"""A megatron-core GPTModel built from a DecoderConfig, with the built-in Decoder's interface for the learner:
`token_logprobs`, and `state_dict` / `load_state_dict` in Hugging Face names (whole tensors, what the rollout
engines load).

Two layer specs: `consistent` (the kernel set's default) puts nemo_rz.ops inside every Megatron submodule
(layers.py), so the logprobs equal the built-in Decoder's and the rollout engines' bit for bit, and equal at
every tensor-parallel size; `fast` is Megatron's own local spec (its column/row-parallel layers with their
all-reduce, torch RMSNorm, DotProductAttention, vocab-parallel cross-entropy): the standard path to compare with.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.parallel.tensor import gather_last, gather_parts
from nemo_rz.runtime.megatron import convert, distributed, layers

# Megatron's own tensor-parallel layers advise, at their first forward, a CUDA stream setting: moot here.
warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS")

# DecoderConfig fields this model builds; any other field must keep its default (a family the Megatron
# learner does not build yet is refused, not trained wrongly).
SUPPORTED = {"vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "rope_theta", "rms_norm_eps", "qk_norm", "attention_bias", "tie_word_embeddings",
             "max_position_embeddings", "sliding_window", "dtype"}


def zero_outside(lp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """lp with 0 where `mask` (the same [B, T-1]) is 0; lp itself without a mask."""
    if mask is None:
        return lp
    return torch.where(mask.to(lp.device) != 0, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))


def check_supported(cfg: DecoderConfig, fast: bool) -> None:
    plain = DecoderConfig(**{k: getattr(cfg, k) for k in SUPPORTED})  # the same model without other features
    for f in dataclasses.fields(cfg):
        if getattr(cfg, f.name) != getattr(plain, f.name):
            raise ValueError(f"model {f.name} = {getattr(cfg, f.name)!r}: the Megatron learner builds dense "
                             "RMSNorm/RoPE/GQA/SwiGLU decoders only; use runtime.learner=builtin for this model")
    if fast and cfg.sliding_window is not None:
        raise ValueError("model sliding_window: the Megatron learner's fast kernels (Megatron's attention) have no "
                         "sliding window; use kernels=consistent or runtime.learner=builtin")


def transformer_config(cfg: DecoderConfig, tp: int) -> TransformerConfig:
    with warnings.catch_warnings():  # a deprecation notice about CUDA graphs, which the learner does not use
        warnings.filterwarnings("ignore", message="full scope is deprecated")
        return _transformer_config(cfg, tp)


def _transformer_config(cfg: DecoderConfig, tp: int) -> TransformerConfig:
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_heads, num_query_groups=cfg.num_kv_heads, kv_channels=cfg.head_dim,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=cfg.attention_bias, qk_layernorm=cfg.qk_norm,
        tensor_model_parallel_size=tp, params_dtype=cfg.torch_dtype, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False,
    )


def layer_spec(cfg: DecoderConfig, fast: bool) -> ModuleSpec:
    """The transformer block: Megatron's local spec (fast) or the same layer with nemo_rz.ops submodules."""
    local = get_gpt_layer_local_spec(qk_layernorm=cfg.qk_norm, normalization="RMSNorm")
    attn = local.submodules.self_attention
    core = functools.partial(layers.CoreAttention, rope_theta=cfg.rope_theta, window=cfg.sliding_window,
                             fast_attention=DotProductAttention if fast else None)
    if fast:
        attn_sub = dataclasses.replace(attn.submodules, core_attention=core)
        layer_sub = dataclasses.replace(local.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub))
        norm = layer_sub.input_layernorm
    else:
        qk = layers.RMSNorm if cfg.qk_norm else attn.submodules.q_layernorm  # IdentityOp without qk-norm
        attn_sub = dataclasses.replace(attn.submodules, linear_qkv=layers.ColumnLinear, core_attention=core,
                                       linear_proj=layers.RowLinear, q_layernorm=qk, k_layernorm=qk)
        layer_sub = dataclasses.replace(local.submodules, input_layernorm=layers.RMSNorm, pre_mlp_layernorm=layers.RMSNorm,
                                        self_attention=dataclasses.replace(attn, submodules=attn_sub),
                                        mlp=layers.MLP)
        norm = layers.RMSNorm
    layer = dataclasses.replace(local, submodules=layer_sub)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers, layer_norm=norm))


class MegatronPolicy(nn.Module):
    """GPTModel over this process's tensor-parallel group (built in the kernel set current at construction)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.fast = ops.get_kernels() != "consistent"
        check_supported(cfg, self.fast)
        self.config, self.tp = cfg, distributed.tp_group()
        self.tp_size, self.tp_rank = dist.get_world_size(self.tp), dist.get_rank(self.tp)
        self.padded_vocab = -(-cfg.vocab_size // self.tp_size) * self.tp_size  # Megatron splits the vocabulary evenly
        mcfg = transformer_config(cfg, self.tp_size)
        tied = cfg.tie_word_embeddings
        self.gpt = GPTModel(mcfg, layer_spec(cfg, self.fast), vocab_size=self.padded_vocab,
                            max_sequence_length=cfg.max_position_embeddings, position_embedding_type="none",
                            share_embeddings_and_output_weights=tied, parallel_output=True)
        if not self.fast:
            if self.tp_size > 1:
                h, d, inner = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
                layers.check_split_outputs({(h, (cfg.num_heads + 2 * cfg.num_kv_heads) * d), (h, 2 * inner),
                                            (cfg.num_heads * d, h), (inner, h), (h, self.padded_vocab)},
                                           self.tp_size, cfg.torch_dtype)
            self.gpt.output_layer = layers.ColumnLinear(cfg.hidden_size, self.padded_vocab, config=mcfg,
                                                        skip_weight_param_allocation=tied, tp_group=self.tp)

    # -- forward ----------------------------------------------------------------------------------
    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits, [B, T, padded_vocab / tp]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, time], got shape {tuple(input_ids.shape)}")
        lo, hi = torch.aminmax(input_ids)
        if int(lo) < 0 or int(hi) >= self.config.vocab_size:
            raise ValueError(f"token id out of range [0, {self.config.vocab_size}) in the model input: "
                             "check the tokenizer matches the model's vocab_size")
        b, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).expand(b, length)
        # Consistent attention is causal by construction; Megatron's own needs the mask (its default is on CUDA).
        mask = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).triu(1)[None, None] if self.fast else None
        return self.gpt(input_ids, positions, mask)

    def token_logprobs(self, input_ids: torch.Tensor, lengths: torch.Tensor | None = None, temperature: float = 1.0,
                       mask: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [B, T-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) at `temperature`; 0 past each length
        and, with `mask` ([B, T-1]), where it is 0 (the built-in Decoder's contract; computed at every position)."""
        b, length = input_ids.shape
        logits = self._logits(input_ids)[:, :-1]
        targets = input_ids[:, 1:]
        vocab = self.config.vocab_size
        if self.fast:
            x = logits.float() / temperature
            if self.padded_vocab != vocab:  # padding columns take no probability
                col = torch.arange(x.shape[-1], device=x.device) + self.tp_rank * x.shape[-1]
                x = x.masked_fill(col >= vocab, float("-inf"))
            lp = -vocab_parallel_cross_entropy(x.transpose(0, 1).contiguous(), targets.t().contiguous()).t()
        else:
            # The vocabulary-parallel log-softmax gathers the logits: its sum over the vocabulary is then exactly
            # ops.log_softmax's (fixed blocks of the whole vocabulary), whatever the TP size.
            full = gather_last(logits, self.tp)[..., :vocab]
            lp = ops.token_logprobs(full.reshape(b * (length - 1), vocab), targets.reshape(-1), temperature).view(b, length - 1)
        if lengths is not None:
            valid = torch.arange(length - 1, device=input_ids.device)[None, :] < (lengths.to(input_ids.device)[:, None] - 1)
            lp = torch.where(valid, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
        return zero_outside(lp, mask)

    # -- weights in Hugging Face names --------------------------------------------------------------
    def _vocab_rows(self, name: str) -> bool:
        return name in ("embedding.word_embeddings.weight", "output_layer.weight")

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        """Whole weights in Hugging Face names (a collective over the tensor-parallel group)."""
        whole = {}
        for name, p in self.gpt.named_parameters():
            parts = list(gather_parts(p.detach(), self.tp).unbind(0)) if self.tp_size > 1 else [p.detach()]
            t = convert.unshard(name, parts, p)
            whole[name] = t[: self.config.vocab_size] if self._vocab_rows(name) else t
        return {k: v.clone() for k, v in convert.to_hf(whole, self.config).items()}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """Load whole Hugging Face-named weights (this rank keeps its part)."""
        try:
            whole = convert.to_megatron(state_dict, self.config)
        except KeyError as e:
            raise ValueError(f"weights for the Megatron learner lack {e.args[0]}: not a checkpoint of this model") from None
        params = dict(self.gpt.named_parameters())
        missing = sorted(set(params) - set(whole))
        if missing:
            raise ValueError(f"weights for the Megatron learner lack {missing[0]} (and {len(missing) - 1} more)")
        for name, p in params.items():
            t = whole[name]
            if self._vocab_rows(name) and self.padded_vocab != t.shape[0]:
                t = F.pad(t, (0, 0, 0, self.padded_vocab - t.shape[0]))
            part = convert.shard(name, t, p, self.tp_rank, self.tp_size)
            if part.shape != p.shape:
                raise ValueError(f"weight {name}: shape {tuple(part.shape)} does not fit the model's {tuple(p.shape)}")
            p.copy_(part)
        return nn.modules.module._IncompatibleKeys([], [])
