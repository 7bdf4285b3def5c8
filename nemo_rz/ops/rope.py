"""Rotary position embedding (rotate-half convention of Llama/Qwen), with the RoPE scaling types the supported
families use: default, linear, llama3 and yarn (`RopeScaling`).

The angles are float32 products position * inv_freq with inv_freq computed in float32, as transformers and
vLLM do: with large q/k-norm weights (Gemma 3) a float64 angle alone moves logits by ~1e-3 from the reference.
cos/sin of those angles are taken in float64 and rounded (correctly rounded whatever code path computes them),
then scaled by the type's attention factor. One table per (head_dim, theta, scaling), indexed by position: a
token's rotation is the same bits whether it is encoded in prefill or in decode.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule (hashable: it keys the table cache). Fields follow transformers' rope_parameters;
    `original_max_position_embeddings` is required by llama3 and yarn."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn (None: from factor, mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE type {self.rope_type!r}: nemo_rz implements {', '.join(ROPE_TYPES)}")
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RoPE factor {self.factor!r}: must be a positive number")
        if self.rope_type in ("llama3", "yarn") and not self.original_max_position_embeddings:
            raise ValueError(f"RoPE type {self.rope_type!r} needs original_max_position_embeddings")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("llama3 RoPE: high_freq_factor must be larger than low_freq_factor")


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.factor
    attention = s.attention_factor
    if attention is None:
        attention = float(mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)) if s.mscale and s.mscale_all_dim else mscale(factor)

    def correction_dim(rotations):
        return head_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as the reference: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep, attention


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, float]:
    """(float32 inverse frequencies [head_dim / 2], attention factor on cos/sin), as transformers computes them."""
    s = scaling or RopeScaling()
    if s.rope_type == "yarn":
        return _yarn(head_dim, theta, s)
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if s.rope_type == "linear":
        freq = freq / s.factor
    elif s.rope_type == "llama3":
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / s.factor, freq)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        freq = torch.where(medium, smoothed, scaled)
    return freq, 1.0


@functools.lru_cache(maxsize=16)
def _table(head_dim: int, theta: float, scaling: RopeScaling | None, length: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    freq, attention = inv_freq(head_dim, theta, scaling)
    angles = (torch.arange(length, dtype=torch.float32)[:, None] * freq[None, :]).double()
    cos, sin = angles.cos().float(), angles.sin().float()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    # Rows laid out for x * cos2 + rotate(x) * sin2 with rotate(x) = [x2, x1]: cos2 = [c, c], sin2 = [-s, s].
    return torch.cat([cos, cos], -1).to(device), torch.cat([-sin, sin], -1).to(device)


def rope_table(head_dim: int, theta: float, length: int, device, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos2, sin2), each [length, head_dim] float32 (see _table); length rounded up so the cache is rarely rebuilt."""
    length = max(1024, 1 << (int(length) - 1).bit_length())
    if scaling is not None and scaling.rope_type == "default":
        scaling = None
    return _table(head_dim, float(theta), scaling, length, str(device))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of each position, [N, 1, head_dim] twice: compute once per forward, pass to every `rope`."""
    n_pos = int(positions.max()) + 1 if positions.numel() else 1
    cos2, sin2 = rope_table(head_dim, theta, n_pos, positions.device, scaling)
    positions = positions.reshape(-1)
    return cos2.index_select(0, positions).unsqueeze(1), sin2.index_select(0, positions).unsqueeze(1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, cos_sin=None) -> torch.Tensor:
    """x [N, H, D] rotated by positions [N]. Only exact IEEE mul/add (and exact negation): identical in both modes.

    x1' = x1 * c + x2 * (-s) = x1 * c - x2 * s and x2' = x2 * c + x1 * s. cos_sin: `rope_cos_sin(positions, D,
    theta, scaling)`, to share across layers.
    """
    half = x.shape[-1] // 2
    c, s = cos_sin if cos_sin is not None else rope_cos_sin(positions, x.shape[-1], theta)
    xf = x.float()
    out = xf * c + torch.cat([xf[..., half:], xf[..., :half]], dim=-1) * s
    return out if out.dtype == x.dtype else out.to(x.dtype)
