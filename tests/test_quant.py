"""nemo_rz.quant against references written here from the recipes' rules: float64 code tables for the element
formats, per-block numpy float32 arithmetic for the recipes (bit for bit), edge values, error bounds, batch
invariance of the row-local forms (per-tensor forms as the negative control) and torchao 0.18 where it
implements the same rule (and its known differences, tested as differences)."""
import math
import re

import numpy as np
import pytest
import torch

from nemo_rz.quant import RECIPES, QTensor, quantize
from nemo_rz.quant.formats import (
    e2m1_codes,
    e2m1_values,
    e8m0_floor_ocp,
    e8m0_round_up,
    exp2_int,
    pack_e2m1,
    to_e4m3,
    to_e5m2,
    unpack_e2m1,
)
from nemo_rz.quant.qtensor import expand

F = np.float32
FLT_MAX = F(np.finfo(np.float32).max)


# ---------------------------------------------------------------- element formats, from their definitions
def magnitudes(ebits: int, mbits: int, bias: int, n_finite: int) -> np.ndarray:
    """Non-negative values of a minifloat by code (float64, exact): subnormals at exponent field 0."""
    out = []
    for e in range(2 ** ebits):
        for m in range(2 ** mbits):
            frac = m / 2 ** mbits
            out.append(frac * 2.0 ** (1 - bias) if e == 0 else (1 + frac) * 2.0 ** (e - bias))
    return np.array(out[:n_finite])


E4M3 = magnitudes(4, 3, 7, 127)  # code 127 is NaN (E4M3 "fn": no inf)
E5M2 = magnitudes(5, 2, 15, 124)  # codes 124.. are inf/NaN
E2M1 = magnitudes(2, 1, 1, 8)


def ref_round(v, table: np.ndarray) -> np.ndarray:
    """Magnitude code of the nearest table value to |v| (ties to the even code), saturating at the top."""
    a = np.minimum(np.abs(np.asarray(v, dtype=np.float64)), table[-1])
    hi = np.clip(np.searchsorted(table, a, side="left"), 0, len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    return np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))


def ref_e4m3(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return (ref_round(v, E4M3) | (np.signbit(v).astype(np.int64) << 7)).astype(np.uint8)


def ref_e2m1(v) -> np.ndarray:
    """E2M1 code; a negative value that rounds to 0 keeps the sign, -0.0 gives code 0 (TE's reference)."""
    v = np.asarray(v, dtype=np.float32)
    return (ref_round(v, E2M1) | ((v < 0).astype(np.int64) << 3)).astype(np.uint8)


def e4m3_value(code) -> np.float32:
    mag = E4M3[int(code) & 0x7F]
    return F(-mag if int(code) & 0x80 else mag)


def e2m1_value(code) -> np.float32:
    mag = E2M1[int(code) & 7]
    return F(-mag if int(code) & 8 else mag)


def neighbours(values) -> np.ndarray:
    """The values, their midpoints, and the fp32 numbers just either side of each, positive and negative."""
    v = np.asarray(values, dtype=np.float64)
    pts = np.concatenate([v, (v[1:] + v[:-1]) / 2]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, F(np.inf)), np.nextafter(pts, F(-np.inf))])
    pts = pts[np.isfinite(pts)]
    return np.concatenate([pts, -pts])


def test_e4m3_all_256_codes_decode_and_reencode():
    codes = torch.arange(256, dtype=torch.uint8)
    decoded = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    for c in range(256):
        if c & 0x7F == 0x7F:
            assert np.isnan(decoded[c])
        else:
            assert decoded[c] == e4m3_value(c), c
    finite = torch.tensor(decoded[~np.isnan(decoded)])
    assert torch.equal(to_e4m3(finite).view(torch.uint8), codes[~torch.isnan(torch.tensor(decoded))])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_is_rne_with_saturation(fmt):
    table, top, cast = (E4M3, 448.0, to_e4m3) if fmt == "e4m3" else (E5M2, 57344.0, to_e5m2)
    rng = np.random.default_rng(0)
    rand = np.exp2(rng.uniform(-24 if fmt == "e5m2" else -14, math.log2(top) + 0.5, 20000)).astype(np.float32)
    above = np.array([top * (1 + 2.0 ** -23), top * 1.03, top * 1.07, top * 1.2, 1e30, FLT_MAX], dtype=np.float32)
    subnormals = np.array([1e-45, 1e-40, 1.1754942e-38], dtype=np.float32)
    v = np.concatenate([neighbours(table), rand, -rand, above, -above, subnormals, -subnormals])
    got = cast(torch.from_numpy(v)).view(torch.uint8).numpy()
    signs = np.signbit(v).astype(np.int64) << 7
    assert np.array_equal(got, (ref_round(v, table) | signs).astype(np.uint8))
    assert cast(torch.tensor([top * 1.5])).float().item() == top  # saturated, not inf/NaN
    # Controls: torch's bare E5M2 cast overflows to inf (why the helpers clamp); its E4M3 cast saturates even
    # inf (why quantize rejects non-finite input instead of relying on the cast).
    assert torch.tensor([57344.0 * 1.2]).to(torch.float8_e5m2).float().isinf().all()
    assert torch.tensor([float("inf")]).to(torch.float8_e4m3fn).float().item() == 448.0


def test_e2m1_rounding_grid_ties_saturation_and_sign():
    rng = np.random.default_rng(1)
    v = np.concatenate([neighbours(E2M1), rng.uniform(-8, 8, 20000).astype(np.float32),
                        np.array([6.0001, 7.0, 1e30, -1e30, 1e-45, -1e-45], dtype=np.float32)])
    assert np.array_equal(e2m1_codes(torch.from_numpy(v)).numpy(), ref_e2m1(v))
    # ties to even: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_values(e2m1_codes(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_codes(torch.tensor([-0.0, -0.1, 0.1])).tolist() == [0, 8, 0]
    assert e2m1_values(torch.arange(16, dtype=torch.uint8)).tolist() == [e2m1_value(c) for c in range(16)]


def test_e2m1_packing_even_element_in_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_e2m1(codes).tolist() == [[0x21, 0xF3]]
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_e2m1(pack_e2m1(codes)), codes)


def test_exp2_int_exact_for_every_exponent():
    k = torch.arange(-149, 128)
    assert exp2_int(k).tolist() == [math.ldexp(1.0, int(i)) for i in k]


def random_fp32(n: int, seed: int) -> np.ndarray:
    """Non-negative finite fp32 values from random bit patterns (all binades, subnormals included)."""
    bits = np.random.default_rng(seed).integers(0, 0x7F800000, n, dtype=np.int64).astype(np.uint32)
    return bits.view(np.float32)


def test_e8m0_round_up_is_the_smallest_power_of_two_not_below():
    v = np.concatenate([random_fp32(20000, 2), np.ldexp(1.0, np.arange(-149, 128)).astype(np.float32), [0.0]])
    v = np.concatenate([v, np.nextafter(v, F(np.inf)), np.nextafter(v, F(0))]).astype(np.float32)
    v = v[np.isfinite(v)]
    ref = []
    for x in v.astype(np.float64):
        e = 0
        while e < 254 and math.ldexp(1.0, e - 127) < x:
            e += 1
        ref.append(e)
    assert e8m0_round_up(torch.from_numpy(v)).tolist() == ref


def test_e8m0_floor_ocp():
    v = np.concatenate([random_fp32(5000, 3), [0.0, 2.0 ** -124, 2.0 ** -125, 6.0, 7.5, 8.0]]).astype(np.float32)
    ref = [127 + max(-127, min(127, (math.frexp(x)[1] - 1 if x > 0 else -1000) - 2)) for x in v.astype(np.float64)]
    assert e8m0_floor_ocp(torch.from_numpy(v), 2).tolist() == ref


def test_mxfp8_round_up_by_multiplying_by_fp32_reciprocal_equals_exact_ceil():
    """One whole binade (every fp32 mantissa): e from amax * fp32(1/448) equals ceil(log2(amax / 448)) exactly."""
    a = ((torch.arange(2 ** 23, dtype=torch.int32)) | (140 << 23)).view(torch.float32)
    got = e8m0_round_up(a * torch.reciprocal(torch.tensor(448.0))).to(torch.int64)
    a64 = a.double()
    k = torch.floor(torch.log2(a64 / 448))
    k = torch.where(448 * torch.exp2(k) >= a64, k, k + 1)  # exact comparisons in float64
    k = torch.where(448 * torch.exp2(k - 1) >= a64, k - 1, k)
    assert torch.equal(got, (k + 127).to(torch.int64))


# ---------------------------------------------------------------- recipe references (numpy float32, per block)
def blocks(shape, block):
    rows, cols = shape
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            yield (slice(i, i + block[0]), slice(j, j + block[1])), (i // block[0], j // block[1])


def grid(shape, block):
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def ref_fp8(x, block, dtype_max, pow2):
    """Current scaling per block: 448/amax, inf -> input dtype max, optional floor to 2**k, amax 0 -> 1."""
    codes = np.zeros(x.shape, np.uint8)
    scale_inv = np.zeros(grid(x.shape, block), np.float32)
    deq = np.zeros(x.shape, np.float32)
    for sl, ij in blocks(x.shape, block):
        amax = np.abs(x[sl]).max()
        with np.errstate(divide="ignore", over="ignore"):
            s = F(448.0) / amax
        if np.isinf(s):
            s = F(dtype_max)
        if pow2:
            s = F(2.0 ** (math.frexp(float(s))[1] - 1))
        if amax == 0:
            s = F(1.0)
        codes[sl] = ref_e4m3(x[sl] * s)
        scale_inv[ij] = F(1.0) / s
        deq[sl] = np.vectorize(e4m3_value)(codes[sl]).astype(np.float32) * scale_inv[ij]
    return codes, scale_inv, deq


def ref_mxfp8(x):
    codes = np.zeros(x.shape, np.uint8)
    exps = np.zeros(grid(x.shape, (1, 32)), np.uint8)
    deq = np.zeros(x.shape, np.float32)
    for sl, ij in blocks(x.shape, (1, 32)):
        p = np.abs(x[sl]).max() * (F(1.0) / F(448.0))  # fp32 product, as TE computes it
        e = 0
        while e < 254 and math.ldexp(1.0, e - 127) < float(p):
            e += 1
        mult = F(1.0) if e == 0 else F(math.ldexp(1.0, 127 - e))  # TE: biased exponent 0 multiplies by 1
        codes[sl] = ref_e4m3(x[sl] * mult)
        exps[ij] = e
        deq[sl] = np.vectorize(e4m3_value)(codes[sl]).astype(np.float32) * F(math.ldexp(1.0, e - 127))
    return codes, exps, deq


def ref_mxfp4(x):
    codes = np.zeros(x.shape, np.uint8)
    exps = np.zeros(grid(x.shape, (1, 32)), np.uint8)
    deq = np.zeros(x.shape, np.float32)
    for sl, ij in blocks(x.shape, (1, 32)):
        amax = float(np.abs(x[sl]).max())
        k = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
        codes[sl] = ref_e2m1(x[sl] * F(math.ldexp(1.0, -k)))
        exps[ij] = k + 127
        deq[sl] = np.vectorize(e2m1_value)(codes[sl]).astype(np.float32) * F(math.ldexp(1.0, k))
    return codes, exps, deq


def ref_nvfp4(x, row_local):
    codes = np.zeros(x.shape, np.uint8)
    scales = np.zeros(grid(x.shape, (1, 16)), np.uint8)
    deq = np.zeros(x.shape, np.float32)
    g_all = np.abs(x).max(axis=1, keepdims=True) if row_local else np.abs(x).max().reshape(1, 1)
    for sl, ij in blocks(x.shape, (1, 16)):
        g = g_all[ij[0] if row_local else 0, 0]
        with np.errstate(divide="ignore", over="ignore"):
            s_enc = min(F(448.0 * 6.0) / g, FLT_MAX)
        s_enc = F(1.0) if s_enc == 0 else s_enc
        s_dec = F(1.0) / s_enc
        amax = np.abs(x[sl]).max()
        s_code = ref_e4m3(min(amax * (s_enc * (F(1.0) / F(6.0))), FLT_MAX))
        s = e4m3_value(s_code)
        with np.errstate(divide="ignore"):
            enc = min(F(1.0) / (s * s_dec), FLT_MAX)
        codes[sl] = ref_e2m1(x[sl] * enc)
        scales[ij] = s_code
        deq[sl] = np.vectorize(e2m1_value)(codes[sl]).astype(np.float32) * ((s * g) * (F(1.0) / F(2688.0)))
    return codes, scales, g_all.astype(np.float32), deq


def edge_input(rows=6, cols=256, seed=0) -> torch.Tensor:
    """Gaussian rows of very different sizes, plus zero, subnormal, format-maximum and just-above-maximum blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 4)
    x[0, :32] = 0.0
    x[0, 32:48] = torch.tensor([1e-45, -3e-42, 1e-40, -1.1754942e-38] * 4)
    x[1, :8] = torch.tensor([448.0, -57344.0, 6.0, -6.0001, 448.00003, 7.5, 0.25, 57344.0 * 1.001])
    x[1, 32:64] = 0.5  # amax 14336 = 448 * 2**5 in block 1, a few ulps above it in block 2
    x[1, 64:96] = 0.5
    x[1, 40], x[1, 70] = 14336.0, -14336.001
    x[2, 64:96] = 1e-37  # an mxfp8 block with biased exponent 0
    x[3, :16] = -0.0
    return x


def unpacked(q: QTensor) -> np.ndarray:
    return unpack_e2m1(q.data).reshape(-1, q.shape[-1]).numpy()


def as_bits_t(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def as_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy() if t.element_size() == 1 else t.numpy()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_current_matches_reference(seed, dtype):
    x = edge_input(seed=seed).to(dtype)
    x[4, :3] = torch.tensor([1e-38, -2e-38, 0.0]).to(dtype)  # a row whose 448/amax overflows fp32
    x[4, 3:] = 0
    xf = x.float().numpy()
    dmax = torch.finfo(dtype).max
    for row_local in (False, True):
        q = quantize(x, "fp8_current", "activation", row_local=row_local)
        block = (1, 256) if row_local else (6, 256)
        codes, scale_inv, deq = ref_fp8(xf, block, dmax, pow2=False)
        assert q.block == block
        assert np.array_equal(as_bits(q.data), codes)
        assert np.array_equal(q.scale.numpy(), scale_inv)
        assert np.array_equal(q.dequantize().numpy(), deq)


@pytest.mark.parametrize("pow2", [None, False])
@pytest.mark.parametrize("role,shape", [("weight", (160, 200)), ("activation", (5, 300))])
def test_fp8_block_matches_reference(role, shape, pow2):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(shape[0], 1, generator=g) * 3)
    x[:, 128:] *= 1e-30  # tiles whose scale overflows fp32 before the power-of-two rounding
    x[0, :128] = 0
    q = quantize(x, "fp8_block", role, pow2_scales=pow2)
    block = (128, 128) if role == "weight" else (1, 128)
    codes, scale_inv, deq = ref_fp8(x.numpy(), block, torch.finfo(torch.float32).max, pow2=pow2 is None)
    assert q.block == block and q.scale.shape == grid(shape, block)
    assert np.array_equal(as_bits(q.data), codes)
    assert np.array_equal(q.scale.numpy(), scale_inv)
    assert np.array_equal(q.dequantize().numpy(), deq)
    if pow2 is None:  # TE's default: power-of-two scales
        assert np.all(np.frexp(q.scale.numpy())[0] == 0.5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mxfp8_matches_reference(seed):
    x = edge_input(seed=seed)
    q = quantize(x, "mxfp8")
    codes, exps, deq = ref_mxfp8(x.numpy())
    assert np.array_equal(as_bits(q.data), codes)
    assert np.array_equal(q.scale.numpy(), exps)
    assert np.array_equal(q.dequantize().numpy(), deq)
    # the round-up at bit level: 14336 = 448 * 2**5 keeps 2**5, a few ulps above takes 2**6
    assert q.scale[1, 1].item() - 127 == 5 and q.scale[1, 2].item() - 127 == 6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mxfp4_matches_reference_ocp_rule(seed):
    x = edge_input(seed=seed)
    x[5, :32] = torch.tensor([7.5] + [0.1] * 31)  # OCP: 2**(floor(log2 7.5) - 2) = 1, so 7.5 saturates to 6
    q = quantize(x, "mxfp4")
    codes, exps, deq = ref_mxfp4(x.numpy())
    assert q.data.shape == (6, 128) and q.data.dtype == torch.uint8
    assert np.array_equal(unpacked(q), codes)
    assert np.array_equal(q.scale.numpy(), exps)
    assert np.array_equal(q.dequantize().numpy(), deq)
    assert q.scale[5, 0].item() == 127 and q.dequantize()[5, 0].item() == 6.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("row_local", [False, True])
def test_nvfp4_matches_reference(seed, row_local):
    x = edge_input(seed=seed)
    q = quantize(x, "nvfp4", "weight", row_local=row_local)
    codes, scales, g, deq = ref_nvfp4(x.numpy(), row_local)
    assert np.array_equal(unpacked(q), codes)
    assert np.array_equal(as_bits(q.scale), scales)
    assert np.array_equal(q.global_scale.numpy(), g)
    assert np.array_equal(q.dequantize().numpy(), deq)


def test_nvfp4_folds_one_sixth_into_the_global_multiplier():
    """amax * (S_enc * fp32(1/6)) as TE's kernel computes it; amax * (S_enc / 6) rounds this block to 1.0."""
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 81.51375579833984, 0.19332225620746613  # found by search: the two orders straddle a tie
    q = quantize(x, "nvfp4")
    assert q.scale.float()[0, 1].item() == 1.125
    assert np.array_equal(as_bits(q.scale), ref_nvfp4(x.numpy(), False)[1])


def test_nvfp4_dequantize_order_matters():
    """(s * G) * (1/2688), TE's order, is not the same function as s * (G / 2688): the reference pins the first."""
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(4))
    q = quantize(x, "nvfp4")
    other = e2m1_values(unpack_e2m1(q.data)) * torch.repeat_interleave(
        q.scale.float() * (q.global_scale / 2688.0), 16, dim=1)
    assert not torch.equal(other, q.dequantize())
    assert torch.equal(q.dequantize(), torch.from_numpy(ref_nvfp4(x.numpy(), False)[3]))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_all_zero_tensor(recipe):
    q = quantize(torch.zeros(3, 128), recipe)
    assert torch.equal(q.dequantize(), torch.zeros(3, 128))
    assert torch.isfinite(q.scale.float()).all()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_roundtrip_error_bounds(recipe):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    q = quantize(x, recipe)
    err = (q.dequantize() - x).abs()
    if RECIPES[recipe].element == "E4M3":  # 3 mantissa bits: half an ulp is 2**-4 relative, 2**-10 absolute at scale
        mult = expand(q.multipliers(), q.block, x.shape)
        assert (err <= (x.abs() * 2 ** -4 + 2 ** -10 * mult) * (1 + 2 ** -20)).all()
    else:
        assert float(err.norm() / x.norm()) < 0.12
    if recipe == "mxfp4":  # unsaturated E2M1 elements are within half a grid step
        step = torch.repeat_interleave(q.multipliers(), 32, 1)
        v = x / step
        ok = v.abs() <= 6
        assert (err[ok] <= torch.maximum(torch.full_like(v, 0.25), v.abs() / 4)[ok] * step[ok]).all()


def test_bfloat16_and_float32_inputs_agree_on_the_same_values():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    for recipe in RECIPES:
        a, b = quantize(x, recipe), quantize(x.float(), recipe)
        assert torch.equal(as_bits_t(a.data), as_bits_t(b.data)) and torch.equal(a.dequantize(), b.dequantize())


def test_shapes_and_dtypes_of_every_recipe():
    x = torch.randn(2, 3, 256)
    expect = {"fp8_current": (torch.float8_e4m3fn, torch.float32, (1, 1)),
              "fp8_block": (torch.float8_e4m3fn, torch.float32, (6, 2)),
              "mxfp8": (torch.float8_e4m3fn, torch.uint8, (6, 8)),
              "mxfp4": (torch.uint8, torch.uint8, (6, 8)),
              "nvfp4": (torch.uint8, torch.float8_e4m3fn, (6, 16))}
    for recipe, (data_dtype, scale_dtype, scale_shape) in expect.items():
        q = quantize(x, recipe, "activation", row_local=False)
        assert q.data.dtype == data_dtype and q.scale.dtype == scale_dtype and tuple(q.scale.shape) == scale_shape
        assert q.recipe == recipe and q.shape == x.shape and q.dequantize().shape == x.shape
        assert q.data.shape[-1] == (128 if data_dtype == torch.uint8 else 256)
        assert (q.global_scale is not None) == (recipe == "nvfp4")
    assert quantize(x, "fp8_current", "activation").scale.shape == (6, 1)  # row-local by default
    assert quantize(x, "fp8_current", "weight").scale.shape == (1, 1)


@pytest.mark.parametrize("bad,where", [(float("nan"), (1, 7)), (float("inf"), (0, 3)), (float("-inf"), (2, 200))])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_non_finite_input_is_an_error_naming_the_position(recipe, bad, where):
    x = torch.randn(3, 256)
    x[where] = bad
    with pytest.raises(ValueError, match=re.escape(f"non-finite value {bad} at index {where}")):
        quantize(x, recipe)


def test_bad_arguments_are_clear_errors():
    x = torch.randn(2, 64)
    for kwargs, msg in [(dict(recipe="fp9"), "unknown recipe"), (dict(recipe="mxfp8", role="bias"), "role"),
                        (dict(recipe="mxfp8", pow2_scales=True), "pow2_scales")]:
        with pytest.raises(ValueError, match=msg):
            quantize(x, **kwargs)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize(x.half(), "mxfp8")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(2, 48), "mxfp4")
    with pytest.raises(ValueError, match="at least one"):
        quantize(torch.tensor(1.0), "fp8_current")


# ---------------------------------------------------------------- batch invariance
def rows_alone_vs_in_batch(recipe: str, row_local: bool | None):
    g = torch.Generator().manual_seed(7)
    request = torch.randn(3, 256, generator=g)
    mates = torch.randn(5, 256, generator=g) * 10  # larger batch mates: a tensor-wide amax comes from them
    batch = torch.cat([mates[:2], request, mates[2:]])
    alone = quantize(request, recipe, "activation", row_local=row_local)
    inside = quantize(batch, recipe, "activation", row_local=row_local)
    same_codes = torch.equal(as_bits_t(alone.data), as_bits_t(inside.data[2:5]))
    same_values = torch.equal(alone.dequantize(), inside.dequantize()[2:5])
    return same_codes and same_values


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_activation_rows_do_not_depend_on_batch_mates(recipe):
    assert rows_alone_vs_in_batch(recipe, None)  # the default for activations


@pytest.mark.parametrize("recipe", ["fp8_current", "nvfp4"])
def test_per_tensor_activation_scaling_breaks_batch_invariance(recipe):
    """Negative control: TE's exact per-tensor form makes a row's codes depend on the rest of the batch."""
    assert RECIPES[recipe].per_tensor_scale
    assert not rows_alone_vs_in_batch(recipe, False)


@pytest.mark.parametrize("recipe", ["fp8_block", "mxfp8", "mxfp4"])
def test_block_recipes_are_row_local_by_construction(recipe):
    assert not RECIPES[recipe].per_tensor_scale
    assert rows_alone_vs_in_batch(recipe, False)


# ---------------------------------------------------------------- torchao 0.18 (optional)
@pytest.fixture(scope="module")
def torchao_mx():
    mx = pytest.importorskip("torchao.prototype.mx_formats")
    from torchao.prototype.mx_formats import kernels, mx_tensor, nvfp4_tensor
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    return mx, kernels, mx_tensor, nvfp4_tensor, ScaleCalculationMode


def test_torchao_e2m1_rounding_equal_except_negative_zero(torchao_mx):
    kernels = torchao_mx[1]
    v = torch.cat([torch.from_numpy(neighbours(E2M1)), torch.linspace(-9, 9, 100001)])
    v = v[~((v == 0) & torch.signbit(v))]
    assert torch.equal(kernels.f32_to_f4_unpacked(v), e2m1_codes(v))
    # stated difference: -0.0 keeps its sign bit in torchao (code 8), TE's reference writes code 0
    assert kernels.f32_to_f4_unpacked(torch.tensor([-0.0])).item() == 8 and e2m1_codes(torch.tensor([-0.0])).item() == 0


def test_torchao_mxfp8_rceil_equal_except_the_lost_round_up(torchao_mx):
    _, _, mx_tensor, _, mode = torchao_mx
    x = edge_input(seed=1)
    x[1, 70] = 14336.0  # no amax a few ulps above 448 * 2**k here (a known difference, below)
    scale, data = mx_tensor.to_mx(x, torch.float8_e4m3fn, 32, mode.RCEIL)
    q = quantize(x, "mxfp8")
    assert torch.equal(scale.view(torch.uint8), q.scale)  # zero and biased-exponent-0 blocks included
    assert torch.equal(data.view(torch.uint8), q.data.view(torch.uint8))
    # stated difference: amax a few ulps above 448 * 2**5; torchao's fp32 ceil(log2) loses the round-up
    y = torch.zeros(1, 32)
    y[0, 0] = 14336.001
    scale, _ = mx_tensor.to_mx(y, torch.float8_e4m3fn, 32, mode.RCEIL)
    assert scale.view(torch.uint8).item() - 127 == 5 and quantize(y, "mxfp8").scale.item() - 127 == 6


def test_torchao_mxfp4_floor_equal_except_tiny_blocks(torchao_mx):
    _, _, mx_tensor, _, mode = torchao_mx
    x = edge_input(seed=2)
    x[0, 32:48] = 0.5  # no fp32-subnormal block here (a known difference, below)
    x[3, :16] = 0.0  # torchao keeps -0.0's sign bit (tested above)
    scale, data = mx_tensor.to_mx(x, torch.float4_e2m1fn_x2, 32, mode.FLOOR)
    q = quantize(x, "mxfp4")
    assert torch.equal(scale.view(torch.uint8).reshape(q.scale.shape), q.scale)
    assert torch.equal(data.view(torch.uint8), q.data)  # also the gpt-oss nibble order
    # stated difference: amax < 2**-124 records 2**-127 (as OCP) but torchao divides by 2**-126
    y = torch.zeros(1, 32)
    y[0, :2] = torch.tensor([2.0 ** -125, -2.0 ** -126])
    scale, data = mx_tensor.to_mx(y, torch.float4_e2m1fn_x2, 32, mode.FLOOR)
    q = quantize(y, "mxfp4")
    assert scale.view(torch.uint8).item() == q.scale.item() == 0
    assert not torch.equal(data.view(torch.uint8), q.data)
    assert q.dequantize()[0, :2].tolist() == [2.0 ** -125, -2.0 ** -126]  # OCP decodes them exactly


def test_torchao_nvfp4_equal_on_ordinary_data_and_its_stated_differences(torchao_mx):
    nv = torchao_mx[3]
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(8))
    g = x.abs().amax()
    scales, data = nv.nvfp4_quantize(x, 16, nv.per_tensor_amax_to_scale(g))
    q = quantize(x, "nvfp4")
    assert torch.equal(scales.view(torch.uint8), q.scale.view(torch.uint8)) and torch.equal(data, q.data)
    # dequantize: torchao multiplies fp4 * (s * (G/2688)), TE (s * G) * (1/2688): at most 1 ulp apart, not equal
    t = nv.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=nv.per_tensor_amax_to_scale(g)).dequantize(torch.float32)
    ulps = (t.view(torch.int32) - q.dequantize().view(torch.int32)).abs()
    assert int(ulps.max()) == 1 and int((ulps > 0).sum()) > 0
    # block scales: torchao clamps them to >= 2**-6; TE lets them round to 0 (a block far below G)
    y = x[:2, :32].clone()
    y[1] *= 1e-6
    scales, _ = nv.nvfp4_quantize(y, 16, nv.per_tensor_amax_to_scale(y.abs().amax()))
    assert scales.float()[1].tolist() == [2.0 ** -6] * 2 and quantize(y, "nvfp4").scale.float()[1].tolist() == [0.0] * 2
    # an all-zero tensor: torchao's scales are NaN, TE's rule gives zeros
    z = torch.zeros(2, 32)
    scales, _ = nv.nvfp4_quantize(z, 16, nv.per_tensor_amax_to_scale(z.abs().amax()))
    assert torch.isnan(scales.float()).all() and quantize(z, "nvfp4").scale.float().eq(0).all()
