"""The quantized linear layer: y = Q(x) @ Q(W).T + b with the recipe's rounding, as Transformer Engine runs it.

Every side (learner, built-in engine, vLLM) quantizes the same high-precision master weights with the same
deterministic function, so their quantized weights agree bit for bit by construction. The weight is quantized
once per weight version (kept on the weight by ops.weight_cache, as ops/gemm.py keeps its weight copy).

Arithmetic: on CPU the codes are dequantized (exact in fp32: an element times its block's decode multiplier,
the one rounding QTensor.dequantize does) and the product is ops.linear's, so consistent mode keeps its fixed
reduction order with fp32 accumulation and fast mode is the library GEMM (the negative control). On CUDA in
consistent mode the Triton kernel dequantizes in the tile (nemo_rz/kernels/quant_matmul.py).

Activations are quantized per row in the recipes with a tensor-wide scale (activation_scaling="row"); TE's
exact per-tensor form ("tensor") makes a token's bits depend on its batch mates. Gradients are straight-through
as in TE: dgrad uses the quantized weight, wgrad the quantized input, and the update lands on the master weight
(gradients themselves stay in high precision).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nemo_rz import ops
from nemo_rz.ops.dispatch import on_gpu_kernels
from nemo_rz.ops.weight_cache import derived, forget_weight_copies
from nemo_rz.quant.qtensor import QTensor
from nemo_rz.quant.recipes import RECIPES, quantize

PRECISIONS = ("none", "bf16", *RECIPES)
MODULE_SETS = ("all", "attention", "mlp", "experts")
ACTIVATION_SCALING = ("row", "tensor")
# Delayed scaling takes its scales from an amax history of earlier batches: a token's bits would depend on them.
_REFUSED = {
    "fp8_delayed": "delayed scaling takes activation scales from an amax history of earlier batches, so a token's "
                   "bits depend on batches it was not in; use fp8_current (row-local current scaling)",
}


@dataclass(frozen=True)
class Precision:
    """What `precision.*` in the config selects: the recipe, which linears it covers, how activations scale."""

    recipe: str = "none"
    modules: str = "all"
    activation_scaling: str = "row"

    def __post_init__(self):
        if self.recipe in _REFUSED:
            raise ValueError(f"precision.recipe={self.recipe} is not supported: {_REFUSED[self.recipe]}")
        for key, value, allowed in (("recipe", self.recipe, PRECISIONS), ("modules", self.modules, MODULE_SETS),
                                    ("activation_scaling", self.activation_scaling, ACTIVATION_SCALING)):
            if value not in allowed:
                raise ValueError(f"precision.{key}={value!r}: use one of {', '.join(allowed)}")

    @classmethod
    def of(cls, spec: "Precision | dict | str | None") -> "Precision":
        """A Precision from itself, a mapping of its fields (a config node, an engine override), a recipe name
        (all linears, row-local activations) or None (no quantization)."""
        if isinstance(spec, cls):
            return spec
        return cls(spec) if isinstance(spec, str) else cls(**dict(spec or {}))

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def as_dict(self) -> dict:
        return {"recipe": self.recipe, "modules": self.modules, "activation_scaling": self.activation_scaling}


def quantize_weight(weight: torch.Tensor, recipe: str) -> QTensor | None:
    """The weight's QTensor (None for bf16, which has no codes or scales)."""
    return None if recipe == "bf16" else quantize(weight.detach(), recipe, "weight")


def dequantized(x: torch.Tensor, recipe: str, role: str, row_local: bool = True) -> torch.Tensor:
    """x rounded as the recipe rounds it, as float32 values (bf16: round-to-nearest-even to bfloat16)."""
    if recipe == "bf16":
        return x.detach().to(torch.bfloat16).to(torch.float32)
    return quantize(x.detach(), recipe, role, row_local=row_local).dequantize()


@torch.no_grad()
def _quantized_values(weight: torch.Tensor, recipe: str) -> tuple[QTensor | None, torch.Tensor]:
    q = quantize_weight(weight, recipe)
    return q, dequantized(weight, "bf16", "weight") if q is None else q.dequantize()


class _StraightThrough(torch.autograd.Function):
    """Forward: `product()`, the layer's output from the already-quantized operands; backward: straight-through
    to x and the master weight, dgrad with Q(W) and wgrad with Q(x)."""

    @staticmethod
    def forward(ctx, x, weight, bias, x_q, w_q, product):
        ctx.save_for_backward(x_q, w_q)
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return product().to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x_q, w_q = ctx.saved_tensors
        x_dt, w_dt, b_dt = ctx.dtypes
        g = grad.reshape(-1, grad.shape[-1]).to(torch.float32)
        grad_x = (g @ w_q).to(x_dt).reshape(*grad.shape[:-1], w_q.shape[1]) if ctx.needs_input_grad[0] else None
        grad_w = (g.t() @ x_q.reshape(-1, x_q.shape[-1])).to(w_dt) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0).to(b_dt) if ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


class Substitute(torch.autograd.Function):
    """Forward: `value` (a quantized operand); backward: the gradient goes to `master` unchanged (straight-through)."""

    @staticmethod
    def forward(ctx, master, value):
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class QuantizedLinear(nn.Module):
    """A linear layer run at `precision`, holding the same weight and bias Parameters as the layer it replaces
    (so state-dict names, optimizers and weight updates are unchanged)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, precision: Precision):
        super().__init__()
        if not precision.enabled:
            raise ValueError("QuantizedLinear: precision.recipe=none needs no quantized layer")
        self.weight, self.bias, self.precision = weight, bias, precision

    def forget(self) -> None:
        """Drop the quantized weight (and every other copy of this layer's weights): ops.forget_weight_copies."""
        forget_weight_copies(self)

    def extra_repr(self) -> str:
        p = self.precision
        w = self.weight
        return f"in={w.shape[1]}, out={w.shape[0]}, recipe={p.recipe}, activations={p.activation_scaling}"

    def quantized_weight(self) -> tuple[QTensor | None, torch.Tensor]:
        """(QTensor, its float32 values) of the current weight version, computed once per version and kept on the
        weight (ops.weight_cache). Writes through `.data` bypass the version counter: call
        ops.forget_weight_copies after them."""
        w, recipe = self.weight, self.precision.recipe
        return derived(w, "quant.linear", lambda: _quantized_values(w, recipe), recipe)

    def weight_values(self) -> torch.Tensor:
        """The weight as this layer's product uses it, [N, K] float32: Q(W)'s values (bf16: W rounded to bfloat16),
        once per weight version; under autograd the gradient goes straight through to the master weight. For a
        product that uses the weight otherwise than as `forward` does (multi-head latent attention absorbs
        kv_b_proj's weight into the per-head query and output products: models/mla.py)."""
        values = self.quantized_weight()[1]
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return Substitute.apply(self.weight, values)
        return values

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.precision
        q_w, w_q = self.quantized_weight()
        row_local = p.activation_scaling == "row"
        if q_w is not None and on_gpu_kernels(x):  # the Triton kernel dequantizes both operands in the tile
            from nemo_rz.kernels.quant_matmul import quant_linear

            q_x = quantize(x.detach(), p.recipe, "activation", row_local=row_local)
            k, n = x.shape[-1], w_q.shape[0]
            def product():
                return quant_linear(q_x, q_w, self.bias).reshape(*x.shape[:-1], n)
            x_q = q_x.dequantize() if torch.is_grad_enabled() else x.new_empty(0, k)
        else:
            x_q = dequantized(x, p.recipe, "activation", row_local)
            def product():
                return ops.linear(x_q, w_q, self.bias)
        return _StraightThrough.apply(x, self.weight, self.bias, x_q, w_q, product)
