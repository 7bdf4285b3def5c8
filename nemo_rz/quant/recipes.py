"""The quantization recipes, named and computed as Transformer Engine computes them (mxfp4: the OCP MX rule).

All arithmetic is fp32 with round-to-nearest-even, in the kernels' order. The tensor is handled as 2-D
[rows, cols] (cols = last dimension); blocks run along cols, and 128x128 weight tiles over both.

Batch invariance: a scale taken over the whole tensor (fp8_current, nvfp4's global amax) makes an
activation row's codes depend on the other rows in the batch. Activations are therefore quantized row-local
by default (the same rule with the amax of the row: TE's `row_scaled_nvfp4` form for nvfp4); `row_local=False`
gives TE's exact per-tensor form. Block recipes (fp8_block 1x128, mxfp8, mxfp4) are row-local by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nemo_rz.quant.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FP32_MAX,
    e2m1_codes,
    e8m0_floor_ocp,
    e8m0_round_up,
    exp2_int,
    f32,
    pack_e2m1,
    rcp,
    to_e4m3,
)
from nemo_rz.quant.qtensor import NVFP4_GLOBAL, QTensor, expand

ROLES = ("weight", "activation")
E2M1_EMAX = 2  # the largest E2M1 power of two is 2**2 (OCP MX: the scale is 2**(floor(log2 amax) - 2))


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax |x| of each block of a 2-D tensor; partial edge blocks cover what is there."""
    rows, cols = x.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.nn.functional.pad(x.abs(), (0, nc * bc - cols, 0, nr * br - rows))
    return padded.reshape(nr, br, nc, bc).amax(dim=(1, 3))


def fp8_scale(amax: torch.Tensor, input_dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """TE's current-scaling rule: 448/amax; inf -> the input dtype's max; optionally rounded down to a power of
    two; amax 0 -> 1."""
    scale = f32(E4M3_MAX) / amax
    scale = torch.where(torch.isinf(scale), f32(torch.finfo(input_dtype).max), scale)
    if pow2:  # keep the exponent bits (scale is positive and normal here)
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return torch.where(amax == 0, f32(1.0), scale)


def _fp8_scaled(x: torch.Tensor, input_dtype: torch.dtype, block: tuple[int, int], pow2: bool, name: str) -> QTensor:
    scale = fp8_scale(block_amax(x, block), input_dtype, pow2)
    data = to_e4m3(x * expand(scale, block, x.shape))
    return QTensor(data, torch.reciprocal(scale), None, block, name, x.shape)


def _tensor_block(x: torch.Tensor, row_local: bool) -> tuple[int, int]:
    return (1, x.shape[1]) if row_local else tuple(x.shape)


def fp8_current(x, input_dtype, role, row_local, pow2):
    """Float8CurrentScaling: one E4M3 scale per tensor (per row when row-local)."""
    return _fp8_scaled(x, input_dtype, _tensor_block(x, row_local), bool(pow2), "fp8_current")


def fp8_block(x, input_dtype, role, row_local, pow2):
    """Float8BlockScaling: E4M3 with a scale per 1x128 (activations) or 128x128 (weights) tile, power-of-two
    scales unless pow2=False (TE's NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1)."""
    block = (128, 128) if role == "weight" else (1, 128)
    return _fp8_scaled(x, input_dtype, block, pow2 is not False, "fp8_block")


def mxfp8(x, input_dtype, role, row_local, pow2):
    """MXFP8BlockScaling: E4M3 with an E8M0 scale per 1x32 block, the exponent rounded up at bit level."""
    block = (1, 32)
    e = e8m0_round_up(block_amax(x, block) * rcp(E4M3_MAX))
    # TE quantizes with 2**(127-e), except that e == 0 multiplies by 1 (its exp2f_rcp); such a block has
    # amax <= 448 * 2**-127, so its codes are zeros (of the elements' signs) either way.
    mult = torch.where(e == 0, f32(1.0), exp2_int(127 - e.to(torch.int32)))
    data = to_e4m3(x * expand(mult, block, x.shape))
    return QTensor(data, e, None, block, "mxfp8", x.shape)


def mxfp4(x, input_dtype, role, row_local, pow2):
    """MXFP4 (OCP MX 6.3, gpt-oss): E2M1 with an E8M0 scale 2**clamp(floor(log2 amax) - 2, -127, 127) per 1x32."""
    block = (1, 32)
    e = e8m0_floor_ocp(block_amax(x, block), E2M1_EMAX)
    codes = e2m1_codes(x * expand(exp2_int(127 - e.to(torch.int32)), block, x.shape))
    return QTensor(pack_e2m1(codes), e, None, block, "mxfp4", x.shape)


def nvfp4(x, input_dtype, role, row_local, pow2):
    """NVFP4 (1x16 blocks, no Hadamard transform, no stochastic rounding): E4M3 block scales under an fp32
    global scale from the tensor's amax (the row's when row-local)."""
    block = (1, 16)
    g = block_amax(x, _tensor_block(x, row_local))  # [1, 1] or [rows, 1]; broadcasts over the blocks
    s_enc = torch.minimum(f32(NVFP4_GLOBAL) / g, f32(FP32_MAX))
    s_enc = torch.where(s_enc == 0, f32(1.0), s_enc)
    s = to_e4m3(torch.minimum(block_amax(x, block) * (s_enc * rcp(E2M1_MAX)), f32(FP32_MAX)))
    enc = torch.minimum(torch.reciprocal(s.to(torch.float32) * torch.reciprocal(s_enc)), f32(FP32_MAX))
    codes = e2m1_codes(x * expand(enc, block, x.shape))
    return QTensor(pack_e2m1(codes), s, g, block, "nvfp4", x.shape)


@dataclass(frozen=True)
class Recipe:
    """A recipe: its Transformer Engine name, what it quantizes to, and whether a scale spans the tensor."""

    name: str
    te_recipe: str
    element: str
    per_tensor_scale: bool  # True: activations need row_local for batch invariance
    fn: Callable[..., QTensor]


RECIPES = {
    r.name: r
    for r in (
        Recipe("fp8_current", "Float8CurrentScaling", "E4M3", True, fp8_current),
        Recipe("fp8_block", "Float8BlockScaling", "E4M3", False, fp8_block),
        Recipe("mxfp8", "MXFP8BlockScaling", "E4M3", False, mxfp8),
        Recipe("mxfp4", "OCP MXFP4 (gpt-oss)", "E2M1", False, mxfp4),
        Recipe("nvfp4", "NVFP4BlockScaling", "E2M1", True, nvfp4),
    )
}


def _check_finite(x: torch.Tensor, what: str) -> None:
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        value = float(x[where])
        raise ValueError(f"{what}: non-finite value {value} at index {where}; quantization needs finite inputs "
                         f"(fix the tensor's producer; no value is clipped or replaced)")


def quantize(x: torch.Tensor, recipe: str, role: str = "weight", row_local: bool | None = None,
             pow2_scales: bool | None = None) -> QTensor:
    """Quantize a float32 or bfloat16 tensor with a recipe from RECIPES.

    role: "weight" or "activation" (fp8_block tiles weights 128x128 and activations 1x128).
    row_local: per-row instead of per-tensor amax for the recipes with a tensor-wide scale (fp8_current,
        nvfp4); default True for activations (batch invariance), False for weights (TE's exact form). Block
        recipes are row-local by construction and ignore it.
    pow2_scales: fp8 scales rounded down to a power of two; default True for fp8_block (TE's default), False
        for fp8_current; only the fp8 recipes take it.
    """
    if recipe not in RECIPES:
        raise ValueError(f"quantize: unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    if role not in ROLES:
        raise ValueError(f"quantize: role must be one of {ROLES}, got {role!r}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantize({recipe}): input must be float32 or bfloat16, got {x.dtype}")
    if x.dim() == 0 or x.numel() == 0:
        raise ValueError(f"quantize({recipe}): input must have at least one dimension and one element, "
                         f"got shape {tuple(x.shape)}")
    if pow2_scales is not None and recipe not in ("fp8_current", "fp8_block"):
        raise ValueError(f"quantize({recipe}): pow2_scales applies to fp8_current and fp8_block only")
    block_cols = {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}.get(recipe)
    if block_cols and x.shape[-1] % block_cols:
        raise ValueError(f"quantize({recipe}): the last dimension ({x.shape[-1]}) must be a multiple of "
                         f"{block_cols}, the recipe's block size (pad the tensor)")
    _check_finite(x, f"quantize({recipe}, {role})")
    if row_local is None:
        row_local = role == "activation"
    x2 = x.to(torch.float32).reshape(-1, x.shape[-1])
    q = RECIPES[recipe].fn(x2, x.dtype, role, bool(row_local), pow2_scales)
    return QTensor(q.data.reshape(*x.shape[:-1], q.data.shape[-1]), q.scale, q.global_scale, q.block, q.recipe,
                   x.shape)
