"""Precision recipes (nemo_rz.quant, `precision.*`) on the Megatron learner: the same quantized weights as the
built-in Decoder's and the rollout engines', and the same quantized product.

`apply_precision(policy, precision)` sets the quantized product (layers.ColumnLinear / RowLinear `product`)
on every linear the recipe selects; the layers themselves know nothing of recipes. Which linears: the Decoder's
rule (quant.apply.selected) on the Hugging Face names a Megatron linear is made of (the family's Megatron map,
convert.joins): attention = linear_qkv and linear_proj, mlp = linear_fc1 and linear_fc2; the LM head and the
embedding stay in the model dtype, as on the Decoder.

The quantized weight is the Decoder's, bit for bit, at every TP size. Megatron fuses q, k and v (and gate and up)
into one weight and splits it over ranks, while the Decoder quantizes each Hugging Face weight whole (fp8_current
and nvfp4 take a scale from the whole tensor's amax, fp8_block tiles it 128 x 128). So once per weight version
(ops.weight_cache) a rank gathers the layer's whole weight (a collective over the tensor-parallel group), splits
it into its Hugging Face parts, quantizes each as the Decoder does (quant.linear.dequantized, role "weight"),
joins them again and keeps its own rows. The product is then quant.linear's own: QuantizedLinear over this
rank's rows of those values (row-local activation quantization of the whole input row, ops.linear with fp32
accumulation, straight-through gradients to the master weight), which gives each output the bits one process
would (ops.linear's products split by output rows: layers.check_split_outputs, checked here in float32).

Refused, in one line each: the fast kernels (Megatron's own linears), activation_scaling=tensor (its amax
spans the batch: Megatron's dense batch has padding rows that the Decoder's packed batch does not), mixtures of
experts' expert weights (the MoE layer's own), and consistent kernels on CUDA (the Decoder runs its Triton
kernel over the codes there, which this product does not call).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_rz.models.config import DecoderConfig
from nemo_rz.ops.dispatch import on_gpu_kernels
from nemo_rz.ops.weight_cache import derived
from nemo_rz.parallel.tensor import gather_parts
from nemo_rz.quant.apply import BLOCK_COLS, selected
from nemo_rz.quant.linear import Precision, QuantizedLinear, dequantized
from nemo_rz.runtime.megatron import convert, layers


class _ShardQuantized(QuantizedLinear):
    """quant.linear's QuantizedLinear whose quantized weight is this rank's rows of the whole weight's
    quantized values (`values()`), not its own quantization of the rows it holds."""

    def __init__(self, weight, bias, precision: Precision, values):
        super().__init__(weight, bias, precision)
        self._values = values

    def quantized_weight(self):
        return None, self._values()


class QuantizedProduct:
    """A linear layer's `product` at `precision` (not a module: it holds the layer's own parameters)."""

    def __init__(self, layer: torch.nn.Module, name: str, join: str, cfg: DecoderConfig, precision: Precision):
        self.layer, self.name, self.join, self.cfg, self.precision = layer, name, join, cfg, precision
        self.group = layer.group
        self.linear = _ShardQuantized(layer.weight, layer.bias, precision, self.values)

    @torch.no_grad()
    def _make(self) -> torch.Tensor:
        w = self.layer.weight
        world = dist.get_world_size(self.group)
        parts = list(gather_parts(w.detach(), self.group).unbind(0)) if world > 1 else [w.detach()]
        whole = convert.unshard(self.name, parts, w)
        recipe = self.precision.recipe
        quantized = [dequantized(p, recipe, "weight", row_local=False)
                     for p in convert.split(self.name, whole, self.cfg, self.join)]
        values = convert.joined(quantized, self.cfg, self.join)
        return convert.shard(self.name, values, w, dist.get_rank(self.group), world).contiguous()

    def values(self) -> torch.Tensor:
        """float32 [rows, K]: this rank's rows of the quantized whole weight (once per weight version)."""
        return derived(self.layer.weight, "megatron.quant", self._make, self.precision.recipe)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight is not self.layer.weight or bias is not self.layer.bias:
            raise ValueError(f"{self.name}: the quantized product runs the layer's own weight and bias only")
        if on_gpu_kernels(x):
            raise ValueError(f"precision.recipe={self.precision.recipe}: the Megatron learner's quantized product is "
                             "the CPU one; on CUDA use runtime.learner=builtin (its Triton kernel is the rollouts')")
        return self.linear(x)


def apply_precision(policy, precision: Precision | dict | str | None):
    """Put `policy`'s (a model.MegatronPolicy) selected linears on the recipe, in place; returns the policy.
    recipe=none changes nothing. One line for what it cannot run (see the module docstring)."""
    precision = Precision.of(precision)
    if not precision.enabled:
        return policy
    cfg = policy.config
    if policy.fast:
        raise ValueError(f"precision.recipe={precision.recipe}: the Megatron learner's fast kernels are Megatron's own "
                         "linears, which run no recipe; use kernels=consistent or runtime.learner=builtin")
    if precision.activation_scaling != "row":
        raise ValueError(f"precision.activation_scaling={precision.activation_scaling}: the Megatron learner quantizes "
                         "activations row by row only (a per-tensor amax would span its batch's padding rows); use row")
    if cfg.num_experts and precision.modules in ("all", "experts"):
        raise ValueError(f"precision.modules={precision.modules}: the Megatron learner does not quantize expert "
                         "weights yet; use precision.modules=attention or mlp, or runtime.learner=builtin")
    table = convert.joins(cfg)
    found = []
    for name, module in policy.gpt.named_modules():
        if not isinstance(module, (layers.ColumnLinear, layers.RowLinear)) or module.weight is None:
            continue
        join, hf = table.get(f"{name}.weight", (None, ()))
        if not hf or not all(selected(n.rsplit(".", 1)[0], precision.modules) for n in hf):
            continue  # the LM head, or a linear the selection leaves out
        block = BLOCK_COLS.get(precision.recipe)
        width = module.weight.shape[1]
        if block and width % block:
            raise ValueError(f"precision.recipe={precision.recipe}: {hf[0].rsplit('.', 1)[0]} has {width} inputs, not "
                             f"a multiple of the recipe's block of {block}; choose another recipe or precision.modules")
        found.append((name, module, join))
    if not found:
        raise ValueError(f"precision.modules={precision.modules}: the model has no such layers "
                         "(choose one of all, attention, mlp that it has)")
    tp = dist.get_world_size(found[0][1].group)
    if tp > 1:  # the products run in float32 over the dequantized values
        shapes = {(m.weight.shape[1], m.weight.shape[0] * tp) for _, m, _ in found}
        layers.check_split_outputs(shapes, tp, torch.float32)
    for name, module, join in found:
        module.product = QuantizedProduct(module, f"{name}.weight", join, cfg, precision)
    return policy
