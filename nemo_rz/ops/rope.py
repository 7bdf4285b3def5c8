"""Rotary position embedding (rotate-half convention of Llama/Qwen).

cos/sin come from one table per (head_dim, theta), computed once in float64 and rounded to float32, then
indexed by position: a token's rotation is the same bits whether it is encoded in prefill or in decode.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=16)
def _table(head_dim: int, theta: float, length: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    # Rows laid out for x * cos2 + rotate(x) * sin2 with rotate(x) = [x2, x1]: cos2 = [c, c], sin2 = [-s, s].
    return torch.cat([cos, cos], -1).to(device), torch.cat([-sin, sin], -1).to(device)


def rope_table(head_dim: int, theta: float, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos2, sin2), each [length, head_dim] float32 (see _table); length rounded up so the cache is rarely rebuilt."""
    length = max(1024, 1 << (int(length) - 1).bit_length())
    return _table(head_dim, float(theta), length, str(device))


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation of each position, [N, 1, head_dim] twice: compute once per forward, pass to every `rope`."""
    n_pos = int(positions.max()) + 1 if positions.numel() else 1
    cos2, sin2 = rope_table(head_dim, theta, n_pos, positions.device)
    positions = positions.reshape(-1)
    return cos2.index_select(0, positions).unsqueeze(1), sin2.index_select(0, positions).unsqueeze(1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float, cos_sin=None) -> torch.Tensor:
    """x [N, H, D] rotated by positions [N]. Only exact IEEE mul/add (and exact negation): identical in both modes.

    x1' = x1 * c + x2 * (-s) = x1 * c - x2 * s and x2' = x2 * c + x1 * s. cos_sin: `rope_cos_sin(positions, D,
    theta)`, to share across layers.
    """
    half = x.shape[-1] // 2
    c, s = cos_sin if cos_sin is not None else rope_cos_sin(positions, x.shape[-1], theta)
    xf = x.float()
    out = xf * c + torch.cat([xf[..., half:], xf[..., :half]], dim=-1) * s
    return out if out.dtype == x.dtype else out.to(x.dtype)
