"""Log-probabilities: log-softmax of (logits / temperature) over the full vocabulary, in float32.

`token_logprobs` is `log_softmax` gathered at the target, so the engine (which needs the full distribution to
sample) and the learner (which needs one number per token) share one arithmetic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import by_recomputing, kernel_op, on_gpu_kernels
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.tiles import TILE_ROWS, from_tiles, row_sum, to_tiles
from nemo_rz.ops.verified import by_rows, rowwise_route

SUM_BLOCK = 128  # the vocabulary is summed in blocks of this many entries, then the block sums are summed


def _scaled(logits: torch.Tensor, temperature) -> torch.Tensor:
    x = logits.float()
    if isinstance(temperature, torch.Tensor):
        return x / temperature.float().reshape(-1, 1)
    return x if temperature == 1.0 else x / float(temperature)


def log_softmax(logits: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """[M, V] -> [M, V] float32. temperature: a float, or one per row ([M] tensor).

    Consistent: the row sum of exp is two-level (blocks of SUM_BLOCK entries, then the block sums), so its
    rounding error grows with the block sizes, not with the vocabulary: within ~4e-6 of float64 at V=151936,
    where one running float32 sum (torch's log_softmax) is off by ~3e-5."""
    if not consistent():
        return _library_log_softmax(logits, temperature)
    if on_gpu_kernels(logits) and not isinstance(temperature, torch.Tensor):
        from nemo_rz import kernels

        t = float(temperature)
        return kernel_op(lambda x: kernels.log_softmax(x, t), by_recomputing(lambda x: _library_log_softmax(x, t)), logits)
    x = _scaled(logits, temperature)
    route = rowwise_route("log_softmax_blocked", _log_softmax_blocked, x.shape[-1], x.dtype, x.device)
    if route is None:
        return log_softmax_tiled(x)
    return _LogSoftmax.apply(x, route)


def _library_log_softmax(logits: torch.Tensor, temperature) -> torch.Tensor:
    """The library's log-softmax (fast mode; differentiated for the GPU kernels' backward: the same math)."""
    return torch.log_softmax(_scaled(logits, temperature), dim=-1)


def _log_softmax_blocked(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The two-level log-softmax of [M, V] with library row-wise ops (used where probed row-invariant), into
    `out` if given. Called without autograd (the backward is _LogSoftmax's)."""
    with torch.no_grad():
        shifted = torch.sub(x, x.amax(dim=-1, keepdim=True), out=out)  # max is exact in any order
        e = torch.exp(shifted)
        if x.shape[-1] % SUM_BLOCK:
            e = F.pad(e, (0, (-x.shape[-1]) % SUM_BLOCK))
        total = e.view(e.shape[0], -1, SUM_BLOCK).sum(-1).sum(-1, keepdim=True)
        return shifted.sub_(torch.log(total))


class _LogSoftmax(torch.autograd.Function):
    """Blocked forward; the library's log-softmax backward (deterministic; needs only the output)."""

    @staticmethod
    def forward(ctx, x, route):
        out = by_rows(_log_softmax_blocked, x, route, width=x.shape[-1])
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return torch._log_softmax_backward_data(grad, out, -1, grad.dtype), None


def log_softmax_tiled(x: torch.Tensor) -> torch.Tensor:
    """Fixed-tile log-softmax; the row sum is two-level (blocks of SUM_BLOCK, then the block sums), so its
    error grows with the block sizes, not with the vocabulary (float32 within ~4e-6 of float64 at V=151936)."""
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

        t = float(temperature)

        def reference(x):
            return _library_log_softmax(x, t).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)

        return kernel_op(lambda x: kernels.token_logprobs(x, targets, t), by_recomputing(reference), logits)
    return log_softmax(logits, temperature).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
