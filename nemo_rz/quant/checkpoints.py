"""Quantized checkpoint tensors read as QTensors and decoded to the float master weights nemo-rz trains.

Two release formats:
- FP8 block-scaled (DeepSeek-V3, Qwen3-FP8: `quantization_config.quant_method = "fp8"`,
  `weight_block_size = [128, 128]`): `X.weight` float8_e4m3fn [N, K] with `X.weight_scale_inv` float32
  [ceil(N/128), ceil(K/128)], value = code * scale_inv of its tile;
- MXFP4 (gpt-oss: `quant_method = "mxfp4"`): `X_blocks` uint8 [..., out, K/32, 16] (two E2M1 codes a byte, the
  even element in the low nibble) with `X_scales` uint8 [..., out, K/32] (E8M0), value = code * 2**(scale-127);
  gpt-oss's expert weights decode to transformers' [E, in, out] layout (`X`, transposed).

Decoding is exact (each value one fp32 product). With the `mxfp4` recipe, quantizing a decoded MXFP4 tensor
again gives back the same values (the OCP rule picks the checkpoint's scale, or a finer one that represents the
same values), so learner and engines keep the release's numbers. An FP8 checkpoint's float32 tile scales are not
powers of two: `fp8_block` with its default power-of-two scales re-rounds them.
"""
from __future__ import annotations

import torch

from nemo_rz.quant.qtensor import QTensor

FP8_BLOCK = (128, 128)


def fp8_block_weight(weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "weight") -> QTensor:
    """An FP8 block-scaled checkpoint weight as a QTensor (fp8_block, 128x128 tiles, float32 scales)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{name}: an FP8 block-scaled weight must be a 2-D float8_e4m3fn tensor, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    tiles = tuple(-(-d // b) for d, b in zip(weight.shape, FP8_BLOCK))
    if tuple(scale_inv.shape) != tiles:
        raise ValueError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)}, expected {list(tiles)} (one scale per "
                         f"128x128 tile of a {list(weight.shape)} weight)")
    return QTensor(weight, scale_inv.to(torch.float32), None, FP8_BLOCK, "fp8_block", weight.shape)


def mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> QTensor:
    """A gpt-oss MXFP4 tensor (`*_blocks` [..., K/32, 16], `*_scales` [..., K/32]) as a QTensor [..., K]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 3 or blocks.shape[-1] != 16 \
            or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{name}: MXFP4 needs uint8 *_blocks [..., K/32, 16] and *_scales [..., K/32], got "
                         f"{blocks.dtype} {tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")
    if bool((scales == 255).any()):
        raise ValueError(f"{name}_scales: E8M0 value 255 is NaN; the checkpoint is damaged")
    lead, groups = tuple(blocks.shape[:-2]), blocks.shape[-2]
    shape = torch.Size(lead + (groups * 32,))
    return QTensor(blocks.reshape(*lead, groups * 16), scales.reshape(-1, groups), None, (1, 32), "mxfp4", shape)


def _gpt_oss_expert(name: str) -> bool:
    return ".experts." in name


def dequantized(tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors with every quantized weight decoded to float32 under its plain name; other tensors
    unchanged. `quantization_config` is config.json's (None: nothing to decode)."""
    if not quantization_config:
        return tensors
    method = quantization_config.get("quant_method")
    out = dict(tensors)
    if method == "fp8":
        block = list(quantization_config.get("weight_block_size") or FP8_BLOCK)
        if block != list(FP8_BLOCK):
            raise ValueError(f"quantization_config.weight_block_size = {block}: only 128x128 FP8 tiles are read")
        for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
            name = key[: -len("_scale_inv")]
            if name not in tensors:
                raise ValueError(f"{key}: its weight {name} is missing from the checkpoint")
            out[name] = fp8_block_weight(tensors[name], out.pop(key), name).dequantize()
    elif method == "mxfp4":
        for key in [k for k in tensors if k.endswith("_blocks")]:
            name = key[: -len("_blocks")]
            scales = tensors.get(name + "_scales")
            if scales is None:
                raise ValueError(f"{key}: its scales {name}_scales are missing from the checkpoint")
            values = mxfp4_blocks(out.pop(key), out.pop(name + "_scales"), name).dequantize()
            out[name] = values.transpose(-1, -2).contiguous() if _gpt_oss_expert(name) else values
    else:
        raise ValueError(f"quantization_config.quant_method = {method!r}: nemo-rz reads fp8 (128x128 block-scaled) "
                         f"and mxfp4 (gpt-oss) checkpoints")
    return out
