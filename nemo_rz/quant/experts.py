"""A mixture-of-experts layer's experts at a precision recipe: both expert products take quantized operands.

Each expert's weight is quantized on its own (as Transformer Engine's grouped linear keeps one quantized weight
per expert), along its input dimension, once per weight version; the rows entering each product are quantized
row-local (the same rule as quant/linear.py, so a (token, expert) pair's bits do not depend on its batch). The
products, the activation and the combine are the model's own consistent ops (ops.expert_linear,
ops.moe_combine): `QuantizedExperts` holds the same Parameters as the experts it replaces and runs their
family's computation with the quantized operands substituted; a test checks that with the quantization made the
identity it equals the family's own forward bit for bit. Gradients are straight-through to the master weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from nemo_rz import ops
from nemo_rz.models.families import gpt_oss, qwen3_moe
from nemo_rz.models.moe import GptOssExperts, Qwen3MoeExperts, adapted
from nemo_rz.ops.weight_cache import derived, forget_weight_copies
from nemo_rz.quant.linear import Precision, dequantized
from nemo_rz.quant.linear import Substitute as _Substitute


@dataclass(frozen=True)
class Family:
    out_in: bool  # weights stored [E, out, in] (else [E, in, out])
    activation: Callable  # (experts module, gate_up [M, 2I]) -> [M, I]


# the activations are the families' own (nemo_rz.models.families), as the experts' forward uses them
FAMILIES = {Qwen3MoeExperts: Family(True, lambda m, gate_up: qwen3_moe.activation(gate_up)),
            GptOssExperts: Family(False, lambda m, gate_up: gpt_oss.activation(gate_up, m.limit))}
WEIGHTS = ("gate_up_proj", "down_proj")


def in_features(experts: nn.Module, name: str) -> int:
    """The input width of an expert product (what the recipe's blocks run along)."""
    w = getattr(experts, name)
    return w.shape[2] if FAMILIES[type(experts)].out_in else w.shape[1]


class QuantizedExperts(nn.Module):
    """The experts of a MoE layer (Qwen3-MoE or gpt-oss family) run at `precision`."""

    def __init__(self, experts: nn.Module, precision: Precision):
        super().__init__()
        self.family = FAMILIES[type(experts)]
        for name, p in experts.named_parameters(recurse=False):
            setattr(self, name, p)
        self.limit = getattr(experts, "limit", None)
        self.out_in = self.family.out_in
        self.precision = precision

    def forget(self) -> None:
        """Drop the quantized weights (and every other copy of these weights): ops.forget_weight_copies."""
        forget_weight_copies(self)

    def extra_repr(self) -> str:
        return f"recipe={self.precision.recipe}, activations={self.precision.activation_scaling}"

    def quantize(self, x: torch.Tensor, role: str) -> torch.Tensor:
        """x [rows, in] rounded as the recipe rounds it (float32 values)."""
        return dequantized(x, self.precision.recipe, role, self.precision.activation_scaling == "row")

    def quantized_weight(self, name: str) -> torch.Tensor:
        """[E, in, out] float32: each expert's weight quantized along `in`, once per weight version (kept on the
        weight by ops.weight_cache; after writes through `.data`, ops.forget_weight_copies)."""
        w, p = getattr(self, name), self.precision
        return derived(w, "quant.experts", lambda: self._quantized_values(w), p.recipe, p.activation_scaling,
                       self.family.out_in)

    @torch.no_grad()
    def _quantized_values(self, w: torch.Tensor) -> torch.Tensor:
        out_in = w.detach() if self.family.out_in else w.detach().transpose(1, 2)
        values = torch.stack([self.quantize(out_in[e], "weight") for e in range(w.shape[0])])
        return values.transpose(1, 2).contiguous()

    def _weight(self, name: str) -> torch.Tensor:
        value = self.quantized_weight(name)
        w = getattr(self, name)
        if not (torch.is_grad_enabled() and w.requires_grad):
            return value
        return _Substitute.apply(w.transpose(1, 2) if self.family.out_in else w, value)

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        value = self.quantize(x, "activation")
        return _Substitute.apply(x, value) if torch.is_grad_enabled() and x.requires_grad else value

    def _product(self, name: str, rows: torch.Tensor, which: torch.Tensor, bias, dtype: torch.dtype) -> torch.Tensor:
        """The quantized product of rows through each row's expert, in `dtype`; a product hook (LoRA's expert adapters)
        sees the rows before quantization, as a LoRA hook on a QuantizedLinear sees its input."""
        y = ops.expert_linear(self._rows(rows), which, self._weight(name), bias).to(dtype)
        return adapted(self, name, rows, which, y)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = experts.shape
        rows, which = x.repeat_interleave(k, dim=0), experts.reshape(n * k)
        bias = getattr(self, "gate_up_proj_bias", None)
        gate_up = self._product("gate_up_proj", rows, which, bias, x.dtype)
        act = self.family.activation(self, gate_up)
        y = self._product("down_proj", act, which, getattr(self, "down_proj_bias", None), x.dtype)
        return ops.moe_combine(y, weights, experts)
