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
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rope_table(head_dim: int, theta: float, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [length, head_dim // 2] float32; length rounded up so the cache is rarely rebuilt."""
    length = max(1024, 1 << (int(length) - 1).bit_length())
    return _table(head_dim, float(theta), length, str(device))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [N, H, D] rotated by positions [N]. Only exact IEEE mul/add/sub: identical in both modes."""
    half = x.shape[-1] // 2
    cos, sin = rope_table(x.shape[-1], theta, int(positions.max()) + 1 if positions.numel() else 1, x.device)
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
