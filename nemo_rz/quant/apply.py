"""Put a model's linear layers on a precision recipe: each selected Linear becomes a QuantizedLinear, and each
selected MoE experts module a QuantizedExperts, holding the same Parameters, so names, state dicts and optimizers
see no change.

Which linears `precision.modules` selects, by their place in the model: attention (self_attn's projections:
q/k/v/o, and multi-head latent attention's q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj),
mlp (a dense MLP's projections), experts (a mixture-of-experts layer's expert projections: the routed experts and
DeepSeek's always-on `shared_experts`), all (all of those). The LM head, the embedding, MoE routers (DeepSeek's
`gate` with its selection bias) and every norm (the latent q_a_layernorm / kv_a_layernorm included) stay in the
model's dtype, as the FP8 / MXFP4 releases keep them (DeepSeek-V3's FP8 release: every projection of attention and
of the routed and shared experts in FP8, the router and norms in high precision).

Latent attention absorbs kv_b_proj into its per-head query and output products (models/mla.py): under a recipe the
absorbed weights are split from Q(kv_b_proj)'s dequantized values (QuantizedLinear.weight_values), once per weight
version; the products' inputs (absorbed queries, attention outputs) stay in high precision.
"""
from __future__ import annotations

from torch import nn

from nemo_rz.models.decoder import Linear
from nemo_rz.ops.weight_cache import forget_weight_copies
from nemo_rz.quant.experts import FAMILIES, WEIGHTS, QuantizedExperts, in_features
from nemo_rz.quant.linear import Precision, QuantizedLinear

BLOCK_COLS = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}  # the recipes that need in_features divisible by a block


ROUTERS = ("gate", "router")  # a MoE layer's router: its logits pick experts, kept in high precision


def _kind(name: str) -> str | None:
    parts = name.split(".")
    if parts[-1] in ROUTERS:
        return None
    if "experts" in parts or "shared_experts" in parts:
        return "experts"
    if "self_attn" in parts:
        return "attention"
    if "mlp" in parts:
        return "mlp"
    return None  # the LM head


def selected(name: str, modules: str) -> bool:
    """Whether the linear at `name` (its qualified name in the model) runs quantized under `modules`."""
    kind = _kind(name)
    return kind is not None and modules in ("all", kind)


def _quantized(child: nn.Module, name: str, precision: Precision) -> nn.Module | None:
    """The quantized replacement of a selected layer (None: not a layer the recipe runs)."""
    if isinstance(child, Linear):
        widths = {name: child.weight.shape[1]}
        def make():
            return QuantizedLinear(child.weight, child.bias, precision)
    elif type(child) in FAMILIES:
        widths = {f"{name}.{w}": in_features(child, w) for w in WEIGHTS}
        def make():
            return QuantizedExperts(child, precision)
    else:
        return None
    block = BLOCK_COLS.get(precision.recipe)
    for where, width in widths.items():
        if block and width % block:
            raise ValueError(f"precision.recipe={precision.recipe}: {where} has {width} inputs, not a multiple of the "
                             f"recipe's block of {block}; choose another recipe or precision.modules")
    return make()


def apply_precision(model: nn.Module, precision: Precision | dict | str | None) -> nn.Module:
    """Replace the selected linear layers and MoE experts of `model` in place; returns the model. recipe=none
    changes nothing.

    Refuses, in one line, a selection that matches no layer and a layer whose input width the recipe's block
    does not divide."""
    precision = Precision.of(precision)
    if not precision.enabled:
        return model
    if getattr(getattr(model, "config", None), "attention_kind", None) == "deepseek_v4":
        raise ValueError(f"precision.recipe={precision.recipe}: DeepSeek-V4 models are not quantized yet (its FP8 / "
                         "MXFP4 layers are not built); use precision.recipe=none")
    swaps = [(parent, child_name, f"{parent_name}.{child_name}".lstrip("."), child)
             for parent_name, parent in model.named_modules() for child_name, child in parent.named_children()
             if (isinstance(child, Linear) or type(child) in FAMILIES)]
    swaps = [s for s in swaps if selected(s[2], precision.modules)]
    if not swaps:
        raise ValueError(f"precision.modules={precision.modules}: the model has no such layers "
                         f"(choose one of all, attention, mlp, experts that it has)")
    for parent, child_name, name, child in [(*s[:3], _quantized(s[3], s[2], precision)) for s in swaps]:
        setattr(parent, child_name, child)
    return model


# The quantized weights are derived copies like any other (ops.weight_cache): the one forget drops them.
forget_quantized_weights = forget_weight_copies
