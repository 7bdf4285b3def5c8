"""Element and scale formats: exact fp32 -> E4M3 / E5M2 / E2M1 rounding and E8M0 exponents.

All rounding is round-to-nearest-even with saturation to the format's largest finite value, as the
hardware's `satfinite` conversions do. E4M3/E5M2 use torch's RNE casts after a clamp (torch 2.13 saturates
E4M3, even inf, but overflows E5M2 to inf; the clamp makes both saturate, and non-finite input is rejected
before it gets here; the tests check every code and every tie). E2M1 has no torch cast on CPU, so it is
rounded here by comparing with the midpoints of its grid.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
FP32_MAX = torch.finfo(torch.float32).max
E8M0_BIAS = 127

# The E2M1 magnitudes by 3-bit code; bit 3 of a code is the sign.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring grid values, and whether a value exactly on one rounds up: ties go to the
# even code (0.25 -> 0, 0.75 -> 1.0 = code 2, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0).
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def f32(value: float) -> torch.Tensor:
    """A float32 scalar tensor (constants enter the arithmetic as fp32, as in the kernels)."""
    return torch.tensor(value, dtype=torch.float32)


def rcp(value: float) -> torch.Tensor:
    """fp32(1/value), correctly rounded in fp32 (what a kernel's `1.0f / value` constant is)."""
    return torch.reciprocal(f32(value))


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, RNE, saturating at +-448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def to_e5m2(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e5m2, RNE, saturating at +-57344."""
    return x.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E2M1 codes (uint8, 0..15), RNE, saturating at +-6.

    A negative value that rounds to zero keeps its sign (code 8); -0.0 itself gives code 0, as TE's
    reference quantizer does.
    """
    mag = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _E2M1_MIDPOINTS:
        code += (mag >= mid if tie_up else mag > mid).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32."""
    grid = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32, device=codes.device)
    return grid[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension, the even element in the low nibble (the gpt-oss layout)."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32 for integer k in [-149, 127], built from bits so that it is exact (subnormals too)."""
    k = k.to(torch.int32)
    normal = (k + E8M0_BIAS).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(0, 22)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def e8m0_value(e: torch.Tensor) -> torch.Tensor:
    """An E8M0 biased exponent (uint8; 255 = NaN is never produced here) -> 2**(e-127) as float32."""
    return exp2_int(e.to(torch.int32) - E8M0_BIAS)


def e8m0_round_up(v: torch.Tensor) -> torch.Tensor:
    """The smallest E8M0 exponent with 2**(e-127) >= v, for finite v >= 0, decided on the fp32 bits.

    This is Transformer Engine's conversion: the exponent field, plus one when any mantissa bit is set
    (saturating at 254); for fp32 subnormals, 2**-127 covers mantissas up to 0x400000, 2**-126 the rest.
    """
    bits = v.view(torch.int32)
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    return (exponent + bump.to(torch.int32)).to(torch.uint8)


def e8m0_floor_ocp(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """OCP MX 6.3 shared exponent: clamp(floor(log2 amax) - emax_elem, -127, 127), biased, for finite amax >= 0.

    floor(log2) is the fp32 exponent field for normal amax; subnormal and zero amax land below -127 and clamp.
    """
    field = amax.view(torch.int32) >> 23
    unbiased = torch.where(field > 0, field - E8M0_BIAS, torch.full_like(field, -E8M0_BIAS - 23))
    return ((unbiased - emax_elem).clamp(-E8M0_BIAS, E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
