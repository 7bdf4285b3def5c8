"""Megatron layer-spec modules whose arithmetic is nemo_rz.ops (the consistent kernels), under any TP size.

No partial result is ever added across tensor-parallel ranks. ops.linear computes each output over the whole
K in one product whose bits depend only on that output's weight row and the input row (measured for every
shape in the tests), so a layer split by output features computes exactly the outputs that one process would:
- ColumnLinear (QKV, gate/up, the output layer): the weight split by output rows, as Megatron's column-parallel
  layers; each rank computes its outputs.
- RowLinear (attention output, down projection): where Megatron splits the weight by input features and
  all-reduces partial sums (whose rounding depends on the TP size), this layer gathers its input instead and
  splits the weight by output rows; each rank computes its outputs over the full K and the outputs are
  gathered. The traffic is about the same as the all-reduce's (gather M x K, then M x N instead of 2 M x N).
Attention heads are whole on one rank (a rank's learned sinks are its heads' slice), norms and activations are
row-wise: nothing else crosses ranks. Gradients are not TP-invariant (Megatron's all-reduce sums the input
gradients); only the forward must be.

The family variants are the Decoder's own arithmetic (models.layers), put where Megatron's TransformerLayer has
a place for them:
- norms (`Norm`): the config's kind (rms, rms_f32, gemma's (1 + w) in float32), models.layers' forward;
- Gemma's post-attention and post-MLP norms (sandwich): Megatron's local layer has no norm after the attention or
  the MLP, so they live in the layer's bias-dropout-add submodules (`self_attn_bda`, `mlp_bda`): `NormAdd` adds
  norm(output) to the residual (parameter `...self_attn_bda.norm.weight`);
- the MLP activation (silu or gelu_tanh: models.layers.gated), learned sinks (`core_attention.sinks`), and the
  embedding scale (`ScaledInputLayer`: the first layer scales its input, the embeddings).
A linear's product is `product(x, weight, bias)`: ops.linear, or a precision recipe's quantized product
(runtime/megatron/precision.py sets it per layer; the layers know nothing of recipes).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from nemo_rz import ops
from nemo_rz.models import layers as decoder_layers
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Tokens
from nemo_rz.parallel.tensor import gather_last


def _group(group):
    """The layer's tensor-parallel group: the one Megatron passed, else its default."""
    if group is not None:
        return group
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    return get_tensor_model_parallel_group()


def _split(size: int, group, what: str) -> int:
    world = group.size()
    if size % world:
        raise ValueError(f"megatron.tp = {world} does not divide {what} = {size}; choose a tp that divides it")
    return size // world


def _mark(weight: nn.Parameter, dim: int) -> nn.Parameter:
    """The attributes Megatron reads on a tensor-parallel weight (which dim is split across ranks)."""
    weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, 1
    return weight


def check_split_outputs(shapes: set[tuple[int, int]], world: int, dtype: torch.dtype) -> None:
    """ops.linear gives each output the same bits with the whole weight [N, K] or with one rank's N / world rows
    of it: what the layers above rely on. That is a property of this machine's BLAS (as the row counts of
    ops.verified are), so it is checked here for every (K, N) the model splits, before any training on it (the
    whole shapes' first calls run their ops.verified probes: up to a minute for a 150k vocabulary)."""
    g = torch.Generator().manual_seed(0)
    for k, n in sorted(shapes):
        x = torch.randn(67, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
        whole = ops.linear(x, w)
        for part, want in zip(w.chunk(world), whole.chunk(world, dim=1)):
            if not torch.equal(ops.linear(x, part), want):
                raise ValueError(f"megatron.tp = {world}: on this machine a [{n}, {k}] product split by output rows "
                                 "does not give the whole product's bits; use megatron.tp=1 for this model")


class ColumnLinear(nn.Module):
    """y[:, outputs of this rank] = ops.linear(x, weight rows of this rank); Megatron's ColumnParallelLinear
    interface (returns (output, bias))."""

    def __init__(self, input_size: int, output_size: int, *, config, bias: bool = False, gather_output: bool = False,
                 skip_bias_add: bool = False, skip_weight_param_allocation: bool = False, tp_group=None, **_):
        super().__init__()
        self.group, self.gather_output, self.skip_bias_add = _group(tp_group), gather_output, skip_bias_add
        rows = _split(output_size, self.group, "the layer's output features")
        dt = config.params_dtype
        self.weight = None if skip_weight_param_allocation else _mark(nn.Parameter(torch.zeros(rows, input_size, dtype=dt)), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(rows, dtype=dt)), 0) if bias else None
        self.product = ops.linear  # (x, weight, bias) -> y; precision.py may set a quantized one

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None):
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        weight = self.weight if weight is None else weight
        x = copy_to_tensor_model_parallel_region(x, group=self.group)  # backward: the ranks' input gradients summed
        y = self.product(x, weight, None if self.skip_bias_add else self.bias)
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            y = gather_last(y, self.group)
        return y, (self.bias if self.skip_bias_add else None)


class RowLinear(nn.Module):
    """Megatron's RowParallelLinear interface (input split by features across ranks, output whole on every
    rank), computed as gather-input, column product, gather-output: no partial sums cross ranks. A bias is
    added in the product, as the Decoder's ops.linear adds it (Megatron asks for it back, `skip_bias_add`, to add
    it in its bias-dropout-add: another rounding in low precision), so no bias is returned."""

    def __init__(self, input_size: int, output_size: int, *, config, bias: bool = False, skip_bias_add: bool = False,
                 tp_group=None, **_):
        super().__init__()
        self.group = _group(tp_group)
        rows = _split(output_size, self.group, "the layer's output features")
        dt = config.params_dtype
        self.weight = _mark(nn.Parameter(torch.zeros(rows, input_size, dtype=dt)), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(rows, dtype=dt)), 0) if bias else None
        self.product = ops.linear

    def forward(self, x: torch.Tensor):
        x = gather_last(x, self.group, grad="sum")
        return gather_last(self.product(x, self.weight, self.bias), self.group), None


class Norm(nn.Module):
    """The model's norm (cfg.norm: models.layers' RMSNorm, RMSNormF32 or GemmaRMSNorm, their forward and initial
    weight) with Megatron's norm interface (config, hidden_size, eps)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, model_config: DecoderConfig | None = None, **_):
        super().__init__()
        self.kind = decoder_layers._NORMS[model_config.norm if model_config is not None else "rms"]
        self.weight = nn.Parameter(torch.full((hidden_size,), self.kind.init, dtype=config.params_dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kind.forward(self, x)


class NormAdd(nn.Module):
    """A bias-dropout-add that is residual + norm(output): Gemma's post-attention / post-MLP norm, in the layer's
    `self_attn_bda` / `mlp_bda` slot (Megatron's TransformerLayer calls `bda(training, fused)(output_with_bias,
    residual, dropout)`). The linears before it return no bias, and the learner has no dropout."""

    def __init__(self, model_config: DecoderConfig):
        super().__init__()
        cfg = model_config
        self.norm = Norm(_Params(cfg.torch_dtype), cfg.hidden_size, cfg.rms_norm_eps, model_config=cfg)

    def forward(self, training: bool, fused: bool):
        def add(output_with_bias, residual, dropout: float):
            out, bias = output_with_bias
            if bias is not None or dropout:
                raise ValueError("NormAdd: a post-norm layer takes outputs without a bias and no dropout")
            return residual + self.norm(out)

        return add


@dataclasses.dataclass
class _Params:
    params_dtype: torch.dtype


@dataclasses.dataclass
class TokenParams(PackedSeqParams):
    """What Megatron hands every layer's core attention (its `packed_seq_params` argument, passed through
    unchanged in the non-`thd` format): the forward's tokens as the built-in Decoder's layers read them (a
    prepared decoder.Tokens in (row, position) order: positions, sequence ids, RoPE rotations, the attention
    plan of this rank's heads, and `attend` where attention runs elsewhere, e.g. over context-parallel ranks)."""

    qkv_format: str = "sbhd"
    tokens: Tokens | None = None


def _flat(x: torch.Tensor) -> torch.Tensor:
    """Megatron's [s, b, heads, d] -> the Decoder's token order [b * s, heads, d]."""
    s, b, h, d = x.shape
    return x.transpose(0, 1).reshape(b * s, h, d)


class CoreAttention(nn.Module):
    """RoPE, then the layer's attention of this rank's heads (q, k, v in Megatron's [s, b, heads, d] layout).

    Megatron applies RoPE with a table it moves to CUDA, so the model is built without position embeddings and
    RoPE happens here, through ops.rope, in both kernel sets. Consistent: models.layers.attend, the built-in
    Decoder's own attention of that layer (window, RoPE kind, sinks), over the tokens of `packed_seq_params`
    (TokenParams); fast: ops.rope, then Megatron's own DotProductAttention (`fast_attention`).

    Learned sinks (one logit per query head, `sinks`) are split by heads as the query heads are: a rank holds
    its heads' sinks and hands that slice to `attend`."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type, softmax_scale=None,
                 model_config: DecoderConfig | None = None, fast_attention: type | None = None, **kwargs):
        super().__init__()
        self.cfg, self.layer = model_config, layer_number - 1  # Megatron counts layers from 1, across stages
        self.sinks = None
        if model_config is not None and model_config.attention_sinks:
            pg = kwargs.get("pg_collection")
            heads = _split(model_config.num_heads, _group(getattr(pg, "tp", None)), "the attention heads")
            self.sinks = _mark(nn.Parameter(torch.zeros(heads, dtype=config.params_dtype)), 0)
        self.fast = None if fast_attention is None else fast_attention(
            config=config, layer_number=layer_number, attn_mask_type=attn_mask_type, attention_type=attention_type,
            softmax_scale=softmax_scale, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        s, b, h, d = query.shape
        t = packed_seq_params.tokens
        if self.fast is not None:
            theta, scaling = self.cfg.rope(self.layer)
            rot = t.ropes[(theta, scaling)]
            query, key = (ops.rope(_flat(x), t.positions, theta, rot).view(b, s, -1, d).transpose(0, 1) for x in (query, key))
            return self.fast(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
        out = decoder_layers.attend(self.cfg, self.layer, _flat(query), _flat(key), _flat(value), t, self.sinks)
        return out.view(b, s, h * d).transpose(0, 1)


class MLP(nn.Module):
    """The gated MLP: fused gate/up (this rank's gate rows, then its up rows, as Megatron's linear_fc1),
    act(gate) * up (models.layers.gated; `act` is the class's: `MLP.of(act)`), then the down projection."""

    act = "silu"

    def __init__(self, config, submodules=None, tp_group=None, **_):
        super().__init__()
        group = _group(tp_group)
        self.linear_fc1 = ColumnLinear(config.hidden_size, 2 * config.ffn_hidden_size, config=config, tp_group=group)
        self.linear_fc2 = RowLinear(config.ffn_hidden_size, config.hidden_size, config=config, tp_group=group)

    @classmethod
    @functools.cache
    def of(cls, act: str) -> type:
        """The MLP class of activation `act` (a class, as Megatron's TransformerLayer wants its dense MLP)."""
        return cls if act == cls.act else type(f"MLP_{act}", (cls,), {"act": act})

    def forward(self, x: torch.Tensor, **_):
        gate_up, _ = self.linear_fc1(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear_fc2(decoder_layers.gated(self.act, gate, up))

class ScaledInputLayer(TransformerLayer):
    """Megatron's TransformerLayer that first multiplies its input by `scale` (in the input's dtype): layer 0 of a
    model with embed_scale (Gemma), whose input is the embeddings, as the Decoder scales them before its layers."""

    def __init__(self, *args, scale: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.embed_scale = scale

    def forward(self, *args, **kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = kwargs["hidden_states"] * self.embed_scale.to(kwargs["hidden_states"].device)
        else:
            args = (args[0] * self.embed_scale.to(args[0].device), *args[1:])
        return super().forward(*args, **kwargs)
