"""QTensor: quantized codes plus the per-block scales that decode them, and the one way to decode them.

Every recipe decodes as `element value * per-block multiplier` in fp32. The tensor is seen as 2-D,
[rows, cols] with cols the last dimension and rows all the others; `scale` is 2-D too,
[ceil(rows / block[0]), ceil(cols / block[1])], so a kernel indexes scale[r // block[0], c // block[1]].
(gpt-oss stores MXFP4 as `*_blocks` [..., cols/32, 16] and `*_scales` [..., cols/32]: `data` and `scale`
reshaped, nothing else.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_rz.quant.formats import e2m1_values, e8m0_value, rcp, unpack_e2m1

NVFP4_GLOBAL = 448.0 * 6.0  # the E4M3 block-scale range times the E2M1 range


def expand(per_block: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor broadcast back to the elements of a 2-D tensor of `shape`."""
    full = per_block.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[: shape[0], : shape[1]]


@dataclass(frozen=True)
class QTensor:
    """A quantized tensor.

    data: float8_e4m3fn codes in the input's shape, or uint8 with two E2M1 codes per byte (even element in the
        low nibble; last dimension halved).
    scale: per-block decode scales in the format's own dtype: float32 (1/scale) for fp8_current and fp8_block,
        uint8 E8M0 biased exponents for mxfp8 and mxfp4, float8_e4m3fn for nvfp4.
    global_scale: nvfp4 only, float32 [1, 1] (per tensor) or [rows, 1] (row-local): the global amax G that TE
        keeps; a block decodes with (scale * G) * fp32(1/2688), in that order (TE's dequantize kernel).
    block: (block rows, block cols) that one scale covers.
    recipe, shape: the recipe's name and the original shape.
    """

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None
    block: tuple[int, int]
    recipe: str
    shape: torch.Size

    def elements(self) -> torch.Tensor:
        """The element values before scaling, float32, as a 2-D [rows, cols] view."""
        if self.data.dtype == torch.uint8:
            values = e2m1_values(unpack_e2m1(self.data))
        else:
            values = self.data.to(torch.float32)
        return values.reshape(-1, self.shape[-1])

    def multipliers(self) -> torch.Tensor:
        """Per-block decode multipliers, float32, shaped like `scale`."""
        if self.scale.dtype == torch.uint8:
            return e8m0_value(self.scale)
        if self.scale.dtype == torch.float8_e4m3fn:
            return (self.scale.to(torch.float32) * self.global_scale) * rcp(NVFP4_GLOBAL)
        return self.scale

    def dequantize(self) -> torch.Tensor:
        """The decoded values, float32, in the original shape."""
        values = self.elements()
        return (values * expand(self.multipliers(), self.block, values.shape)).reshape(self.shape)
