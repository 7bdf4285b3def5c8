"""Log-probabilities: log-softmax of (logits / temperature) over the full vocabulary, in float32.

`token_logprobs` is `log_softmax` gathered at the target, so the engine (which needs the full distribution to
sample) and the learner (which needs one number per token) share one arithmetic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import on_gpu_kernels
from nemo_rz.ops.mode import consistent
from nemo_rz.ops.tiles import TILE_ROWS, from_tiles, row_sum, to_tiles
from nemo_rz.ops.verified import by_rows, rowwise_route

SUM_BLOCK = 256  # the vocabulary is summed in blocks of this many entries, then the block sums are summed


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
    x = _scaled(logits, temperature)
    route = rowwise_route("log_softmax", _library_log_softmax, x.shape[-1], x.dtype, x.device)
    if route is not None:
        return by_rows(_library_log_softmax, x, route)
    return _log_softmax_tiled(x)


def _library_log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1)


def _log_softmax_tiled(x: torch.Tensor) -> torch.Tensor:
    """Fixed-tile log-softmax; the row sum is two-level (blocks of SUM_BLOCK, then the block sums), so its
    error grows with sqrt of the block sizes, not of the vocabulary (float32 within ~1e-6 of float64)."""
    rows, vocab = x.shape
    t = to_tiles(x)
    with torch.no_grad():  # the shift cancels in log-softmax (exact max, any order): no gradient through it
        shift = t.amax(dim=-1, keepdim=True)
    shifted = t - shift
    e = torch.exp(shifted)
    pad = (-vocab) % SUM_BLOCK
    blocks = F.pad(e, (0, pad)).view(-1, TILE_ROWS, SUM_BLOCK)  # each row's blocks, whole tiles of them
    partial = row_sum(blocks).view(-1, TILE_ROWS, (vocab + pad) // SUM_BLOCK)
    return from_tiles(shifted - torch.log(row_sum(partial)), rows)


def probabilities(logprobs: torch.Tensor) -> torch.Tensor:
    """exp of [M, V] log-probabilities, each row's bits independent of the other rows (for sampling)."""
    route = rowwise_route("exp", torch.exp, logprobs.shape[-1], logprobs.dtype, logprobs.device)
    if route is not None:
        return by_rows(torch.exp, logprobs, route)
    # Whole row tiles: no element falls into a vectorised loop's scalar tail.
    return from_tiles(torch.exp(to_tiles(logprobs)), logprobs.shape[0])


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """[M, V], [M] -> [M] float32: log p(target | row)."""
    if on_gpu_kernels(logits) and not isinstance(temperature, torch.Tensor):
        from nemo_rz import kernels

        return kernels.token_logprobs(logits, targets, float(temperature))
    return log_softmax(logits, temperature).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
