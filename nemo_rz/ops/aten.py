"""`batch_invariant()`: make a foreign torch model (transformers, Megatron) batch-invariant.

Inside the context, aten's mm, addmm, bmm, _log_softmax and mean.dim are overridden for one dispatch key
(`device`, CPU by default) through torch.library with fixed-row-tile implementations in torch (the same rule as
nemo_rz.ops's tiles). There is no Triton path here: with device="CUDA" the same torch code runs on the GPU.
Autograd is untouched: the overrides sit below it, at the backend key.
The overrides call `bmm.out`, which is not overridden, so they never recurse.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from nemo_rz.ops.logprobs import log_softmax_tiled
from nemo_rz.ops.tiles import TILE_ROWS

_OVERRIDDEN = ("mm", "addmm", "bmm", "_log_softmax", "mean.dim")


def _bmm_raw(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    return torch.ops.aten.bmm.out(a, b, out=out)


def _tiled_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[C, M, K] @ [C or 1, K, N], each row computed in a [TILE_ROWS, K] tile regardless of M (see tiles.py)."""
    c, rows, k = a.shape
    n = b.shape[2]
    pad = (-rows) % TILE_ROWS or (TILE_ROWS if rows == 0 else 0)
    a = torch.nn.functional.pad(a, (0, 0, 0, pad))
    if n == 1:
        b = torch.nn.functional.pad(b, (0, 1))
    per = a.shape[1] // TILE_ROWS
    tiles = a.reshape(c * per, TILE_ROWS, k)
    b = b.expand(c * per, k, b.shape[2]) if b.shape[0] == 1 else b.repeat_interleave(per, dim=0)
    out = _bmm_raw(tiles, b)
    return out.reshape(c, per * TILE_ROWS, -1)[:, :rows, :n]


def _mm(a, b):
    return _tiled_bmm(a.unsqueeze(0), b.unsqueeze(0))[0]


def _addmm(bias, a, b, *, beta=1, alpha=1):
    out = _mm(a, b)
    if alpha != 1:
        out = out * alpha
    if beta == 0:  # as torch: the bias is ignored, NaN or inf included
        return out
    return out + (bias if beta == 1 else bias * beta)


def _bmm(a, b):
    return _tiled_bmm(a, b)


def _row_sum_last(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    ones = rows.new_ones(1, rows.shape[-1], 1)
    return _tiled_bmm(rows.unsqueeze(0), ones)[0].reshape(x.shape[:-1])


def _log_softmax(x, dim, half_to_float):
    xt = (x.float() if half_to_float else x).movedim(dim, -1)
    out = log_softmax_tiled(xt.reshape(-1, xt.shape[-1])).view(xt.shape)  # blocked two-level sum: accurate
    return out.movedim(-1, dim).contiguous()


def _mean_dim(x, dim, keepdim=False, *, dtype=None):
    xt = x.to(dtype) if dtype is not None else x
    dims = sorted(d % xt.dim() for d in (dim if dim else range(xt.dim())))
    moved = xt.movedim(dims, list(range(xt.dim() - len(dims), xt.dim())))
    kept = moved.shape[: xt.dim() - len(dims)]
    flat = moved.reshape(*kept, -1)
    out = _row_sum_last(flat) / flat.shape[-1]
    if keepdim:
        for d in dims:
            out = out.unsqueeze(d)
    return out


_IMPLS = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "_log_softmax": _log_softmax, "mean.dim": _mean_dim}


@contextlib.contextmanager
def batch_invariant(device: str = "CPU"):
    """Override aten matmul/bmm/log-softmax/mean with batch-invariant versions while the block runs."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Warning only once for all operators")
            for name in _OVERRIDDEN:
                lib.impl(name, _IMPLS[name], device)
        yield
    finally:
        lib._destroy()
