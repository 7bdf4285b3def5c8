"""Derived copies of weights, kept on the weight until it changes, and the one function that drops them all.

Several places compute a copy of a weight once and reuse it until the weight changes: the contiguous [K, N]
GEMM operand of a linear weight not already stored so (ops/gemm.py: a weight in the usual contiguous [N, K]
layout, or a bfloat16 weight where the C++ rows kernel is not admitted; a Linear's weight, and a tied embedding
as LM head, are their own operands, models/layers.py), the [E, in, out]
layout of stacked expert weights (models/moe.py), float32 copies of bfloat16 expert weights (ops/moe.py),
quantized weights (quant/linear.py, quant/experts.py), a draft's rows of its target's LM head (models/draft.py).
All of them live here, in one dict on the source tensor (attribute `ATTR`, {kind: (key, copy)}: one copy per
kind, so a weight never holds two copies of one kind), keyed by `key(source)`: the version counter (it moves on every in-place update: an
optimizer step, `copy_`, `mul_`), the data pointer, shape and dtype (they change when `.data` is replaced),
plus what else the copy depends on (a target dtype, a recipe).

What no key sees: writes *through* `.data` (`p.data.copy_(new)`, as vLLM's weight loaders write; `.data` has
a version counter of its own) and writes into inference tensors (which have none). Whoever writes weights that
way calls `forget_weight_copies(module)` afterwards, which drops every copy of every kind. A copy may itself
hold copies (the float32 copy of a transposed expert weight lives on the transposed copy): dropping the outer
one drops them with it.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

ATTR = "_nemo_rz_copies"  # the attribute on a source tensor: {kind: (key, copy)}

T = TypeVar("T")


def key(source: torch.Tensor) -> tuple:
    """What identifies the values of `source` as far as PyTorch can tell without reading them."""
    version = None if source.is_inference() else source._version
    return version, source.data_ptr(), tuple(source.shape), source.dtype


def derived(source: torch.Tensor, kind: str, make: Callable[[], T], *depends) -> T:
    """`make()`, computed once and kept on `source` under `kind` until `key(source)` or `depends` changes (then
    the new value replaces the old: one value per kind). `make` reads `source` (detached, under no_grad as it
    needs) and `depends` are hashable values it also reads (a dtype, a recipe, another tensor's key)."""
    k = (key(source), depends)
    copies = source.__dict__.get(ATTR)
    if copies is None:
        copies = source.__dict__[ATTR] = {}
    hit = copies.get(kind)
    if hit is not None and hit[0] == k:
        return hit[1]
    copies.pop(kind, None)  # the old copy goes before the new one is made: at most one alive
    value = make()
    copies[kind] = (k, value)
    return value


def forget_tensor_copies(*tensors: torch.Tensor | None) -> None:
    """Drop every derived copy kept on these tensors."""
    for t in tensors:
        if t is not None:
            t.__dict__.pop(ATTR, None)


def forget_weight_copies(module: torch.nn.Module) -> None:
    """Drop every derived copy (GEMM operands, expert layouts, float32 and quantized copies, draft head rows)
    kept on the parameters and buffers of `module`: after writing them through `.data`, which no version
    counter sees."""
    forget_tensor_copies(*module.parameters(), *module.buffers())
