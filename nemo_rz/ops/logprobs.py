"""Log-probabilities: log-softmax of (logits / temperature) over the full vocabulary, in float32.

`token_logprobs` is `log_softmax` gathered at the target, so the engine (which needs the full distribution to
sample) and the learner (which needs one number per token) share one arithmetic.
"""
from __future__ import annotations

import torch

from nemo_rz.ops.dispatch import on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import from_tiles, row_sum, to_tiles


def _scaled(logits: torch.Tensor, temperature) -> torch.Tensor:
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        return x / temperature.float().reshape(-1, 1)
    return x if temperature == 1.0 else x / float(temperature)


def log_softmax(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """[M, V] -> [M, V] float32. temperature: a float, or one per row ([M] tensor)."""
    if not consistent():
        return torch.log_softmax(_scaled(logits, temperature), dim=-1)
    if on_gpu_kernels(logits) and not isinstance(temperature, torch.Tensor):
        from nemo_rz import kernels

        return kernels.log_softmax(logits, float(temperature))
    rows = logits.shape[0]
    t = to_tiles(_scaled(logits, temperature))
    shifted = t - t.amax(dim=-1, keepdim=True)  # max is exact in any order
    lse = torch.log(row_sum(torch.exp(shifted)))
    return from_tiles(shifted - lse, rows)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """[M, V], [M] -> [M] float32: log p(target | row)."""
    if on_gpu_kernels(logits) and not isinstance(temperature, torch.Tensor):
        from nemo_rz import kernels

        return kernels.token_logprobs(logits, targets, float(temperature))
    return log_softmax(logits, temperature).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
