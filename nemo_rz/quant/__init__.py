"""Low-precision quantizers matched to Transformer Engine's recipes bit for bit (mxfp4: the OCP MX rule).

`quantize(x, recipe, role)` returns a `QTensor` (codes, per-block scales, `dequantize()`); RECIPES lists
fp8_current, fp8_block, mxfp8, mxfp4 and nvfp4. Activations are row-local by default (batch invariance).
"""
from nemo_rz.quant.qtensor import QTensor
from nemo_rz.quant.recipes import RECIPES, quantize

__all__ = ["QTensor", "RECIPES", "quantize"]
