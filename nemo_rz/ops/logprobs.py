"""Log-probabilities: log-softmax of (logits / temperature) over the full vocabulary, in float32.

`token_logprobs` is `log_softmax` gathered at the target, so the engine (which needs the full distribution to
sample) and the learner (which needs one number per token) share one arithmetic. `lm_head_logprobs` is
`token_logprobs(linear(hidden, weight))` computed a chunk of rows at a time, forward and backward, so the learner
never holds the whole [tokens, vocab] float32 logits.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import by_recomputing, kernel_op, on_gpu_kernels
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.linear import linear
from nemo_rz.ops.tiles import TILE_ROWS, from_tiles, row_sum, to_tiles
from nemo_rz.ops.verified import by_rows, rowwise_route

SUM_BLOCK = 128  # the vocabulary is summed in blocks of this many entries, then the block sums are summed
HEAD_CHUNK_BYTES = 16 << 20  # lm_head_logprobs: a chunk's [rows, vocab] float32 logits stay within this (16 MiB)


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
        return by_rows(torch.exp, logprobs, route, elementwise=True)
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


def head_chunk_rows(vocab: int) -> int:
    """Rows per chunk of lm_head_logprobs: a multiple of TILE_ROWS whose [rows, vocab] float32 fits
    HEAD_CHUNK_BYTES (at least TILE_ROWS)."""
    return max(TILE_ROWS, HEAD_CHUNK_BYTES // (4 * vocab) // TILE_ROWS * TILE_ROWS)


def lm_head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature=1.0,
                     chunk: int | None = None) -> torch.Tensor:
    """hidden [N, H], LM-head weight [V, H], targets [N] -> [N] float32: `token_logprobs(linear(hidden, weight),
    targets, temperature)`, a chunk of `chunk` rows (default head_chunk_rows(V)) at a time.

    The forward is those two ops on each chunk, so (both row-invariant in consistent mode) its bits are the
    unchunked ones. The backward recomputes each chunk's logits and adds its products to grad_hidden and
    grad_weight in chunk order: deterministic, within float rounding of the unchunked gradient. temperature: a
    float, or one per row ([N] tensor). With the GPU kernels: the unchunked ops (their own backward)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(f"lm_head_logprobs: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} and targets "
                         f"{tuple(targets.shape)} must be [N, H], [V, H] and [N]; pass the final hidden states of N tokens")
    if chunk is not None and chunk < 1:
        raise ValueError(f"lm_head_logprobs: chunk = {chunk}: must be >= 1 rows")
    if on_gpu_kernels(hidden):
        return token_logprobs(linear(hidden, weight), targets, temperature)
    rows = chunk or head_chunk_rows(weight.shape[0])
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _HeadLogprobs.apply(hidden, weight, targets, temperature, rows)
    return _head_forward(hidden, weight, targets, temperature, rows)


def _chunks(n: int, rows: int):
    return (slice(start, min(start + rows, n)) for start in range(0, n, rows))


def _row_temperature(temperature, rows: slice):
    return temperature[rows] if isinstance(temperature, torch.Tensor) else temperature


def _head_forward(hidden, weight, targets, temperature, rows: int) -> torch.Tensor:
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for c in _chunks(hidden.shape[0], rows):
            out[c] = token_logprobs(linear(hidden[c], weight), targets[c], _row_temperature(temperature, c))
    return out


class _HeadLogprobs(torch.autograd.Function):
    """Chunked forward; the backward of log-softmax-gather and of the product, one recomputed chunk at a time.

    Per chunk, with p = softmax(logits / T): d logits = (onehot(target) - p) * grad / T; grad_hidden gets
    d logits @ W and grad_weight d logits.T @ hidden, summed over the chunks in order (float32)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, rows):
        ctx.save_for_backward(hidden, weight, targets, temperature if isinstance(temperature, torch.Tensor) else None)
        ctx.temperature, ctx.rows = temperature, rows
        return _head_forward(hidden, weight, targets, temperature, rows)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, t_rows = ctx.saved_tensors
        temperature = ctx.temperature if t_rows is None else t_rows
        need_h, need_w = ctx.needs_input_grad[:2]
        w = weight.detach().float()
        grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for c in _chunks(hidden.shape[0], ctx.rows):
            h, g, t = hidden[c].detach().float(), grad[c].float()[:, None], _row_temperature(temperature, c)
            d = torch.softmax(_scaled(torch.mm(h, w.t()), t), dim=-1).mul_(-g)
            d.scatter_add_(1, targets[c].long()[:, None], g)
            if isinstance(t, torch.Tensor):
                d.div_(t.float().reshape(-1, 1))
            elif t != 1.0:
                d.div_(float(t))
            if need_h:
                torch.mm(d, w, out=grad_h[c])
            if need_w:
                grad_w.addmm_(d.t(), h)
        return (None if grad_h is None else grad_h.to(hidden.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None, None, None)
