"""Library kernels proven row-invariant on this machine, by a probe at first use.

The fixed row tiles (tiles.py) are row-invariant by construction, but cost one small BLAS product per 32 rows
(and a slow backward). Some platform kernels are row-invariant by themselves: with one thread, MKL's float32
GEMM gives a row the same bits for every row count from 2 up to a shape-dependent size (torch 2.13 CPU,
AVX-512), and ATen's last-dim log_softmax, RMSNorm's mean of squares and silu compute each row alone. That is a
property of the BLAS build, the CPU and the thread count, not a promise, so nemo_rz uses a library kernel only
after a probe on this machine has compared, bit for bit, every row of calls over a spread of row counts against
one reference call of a chunk of rows. The probe yields a `Route`: calls are then never larger than its chunk
nor smaller than its min_rows (zero-padded), so every row count that can occur lies in the probed range. A
shape that fails its probe keeps the fixed tiles. Probes and routed calls run on one thread whatever the
process's thread count (a BLAS splits a product across threads by its shape), so a route never depends on how
many threads a process uses: a 2-thread learner and a 1-thread rollout worker compute the same bits.

What the probes found here: MKL's GEMM is row-invariant only with the weight as a contiguous [K, N] matrix (with
the transposed view of a [N, K] Linear weight, calls of up to 15 rows take other paths); one row (a
matrix-vector product) always takes another path; and MKL switches paths at some row count that depends on the
shape (between 128 and 200 rows for K=4864, N=896), hence several chunk sizes.

`NEMO_RZ_VERIFIED=0` turns the library routes off (fixed tiles everywhere).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Callable

import torch
import torch.nn.functional as F

CHUNK_ROWS = (256, 128, 64)  # chunk sizes tried, largest first
MAX_MIN_ROWS = 4  # a route may pad calls up to this many rows, no more
# Row counts probed (those below the chunk size) against one call of a whole chunk: every count up to 17 (small
# decode batches, where BLAS paths change most), then both sides of the powers of two where blocking changes,
# up to the largest chunk a row-wise op may use.
PROBE_ROWS = tuple(range(1, 18)) + (23, 31, 32, 33, 47, 63, 64, 65, 96, 127, 128, 129, 191, 200, 255, 256, 257,
                                    511, 512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 4095)
BMM_ROWS = (4, 8, 16, 32)  # per-matrix row counts a batched product may be called with (attention tiles)

_ALIGN = 64  # bytes: the CPU allocator's alignment; a view off it is copied, so the library sees what the probe saw
_ENABLED = os.environ.get("NEMO_RZ_VERIFIED", "1") != "0"
_RESULTS: dict = {}
_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Route:
    """Calls of min_rows..chunk rows give every row the same bits."""

    chunk: int
    min_rows: int


@contextlib.contextmanager
def one_thread():
    """Run the block with one torch thread (cheap: ~0.1 us to switch), restoring the count afterwards."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _aligned(x: torch.Tensor) -> torch.Tensor:
    if not x.is_contiguous():
        return x.contiguous()
    return x if x.data_ptr() % _ALIGN == 0 else x.clone()


def by_rows(fn: Callable, x: torch.Tensor, route: Route, width: int | None = None) -> torch.Tensor:
    """fn (a row-wise map) over x [M, K] in calls of route.min_rows..route.chunk rows: fewer rows are
    zero-padded, more are cut into chunks. With `width`, fn(rows, out) writes its [rows, width] result into
    `out` (no copy; no autograd); without it, fn(rows) returns it (differentiable)."""
    m, low_rows = x.shape[0], route.min_rows
    with one_thread():
        if m < low_rows:
            x = F.pad(x, (0, 0, 0, low_rows - m))
        if x.shape[0] <= route.chunk:
            x = _aligned(x)
            out = fn(x) if width is None else fn(x, x.new_empty(x.shape[0], width))
            return out if out.shape[0] == m else out[:m]
        if width is not None:
            out = x.new_empty(m, width)
        parts = []
        for start in range(0, m, route.chunk):
            stop = min(start + route.chunk, m)
            low = min(start, stop - low_rows)  # a short last chunk is computed inside a min_rows call ending with it
            rows = _aligned(x[low:stop])
            if width is None:
                parts.append(fn(rows)[start - low :])
            elif low == start:
                fn(rows, out[start:stop])
            else:
                out[start:stop] = fn(rows, rows.new_empty(stop - low, width))[start - low :]
        return torch.cat(parts) if width is None else out


def failing_rows(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> list[int]:
    """The probed row counts M (below C) for which fn, a row-wise map of [M, K] -> [M, N], gives some row of
    `rows` ([C, K]) other bits than one call on all C rows."""
    reference, total = fn(rows), rows.shape[0]
    bad = []
    for m in (m for m in PROBE_ROWS if m < total):
        start = (m * 37) % (total - m + 1)  # rows from all over the reference
        # A fresh (aligned, contiguous) input, as by_rows hands the library.
        if not torch.equal(fn(rows[start : start + m].clone()), reference[start : start + m]):
            bad.append(m)
    return bad


def verified(kind: str, key: tuple, probe: Callable[[], object]):
    """probe()'s result for (kind, key), computed once per process; None where library routes are off."""
    if not _ENABLED:
        return None
    full_key = (kind, *key)
    if full_key not in _RESULTS:
        with _LOCK:
            if full_key not in _RESULTS:
                with torch.no_grad(), one_thread():
                    _RESULTS[full_key] = probe()
    return _RESULTS[full_key]


def _route(fn: Callable[[torch.Tensor], torch.Tensor], features: int, dtype, device,
           chunks: tuple[int, ...] = CHUNK_ROWS) -> Route | None:
    """The largest chunk whose probe fails only below MAX_MIN_ROWS rows, with the smallest safe min_rows."""
    for chunk in chunks:
        g = torch.Generator().manual_seed(features)
        rows = (torch.randn(chunk, features, generator=g) * 4.0).to(dtype=dtype, device=device)
        bad = failing_rows(fn, rows)
        if all(m < MAX_MIN_ROWS for m in bad):
            return Route(chunk, max(bad, default=0) + 1)
    return None


def matmul_route(k: int, n: int, dtype: torch.dtype, device) -> Route | None:
    """How torch.mm(x, w_t), x [M, k], w_t a contiguous [k, n], is row-invariant here (None: it is not)."""

    def probe() -> Route | None:
        g = torch.Generator().manual_seed(n)
        w_t = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype=dtype, device=device)
        return _route(lambda x: torch.mm(x, w_t), k, dtype, device)

    return verified("mm", (k, n, dtype, str(device)), probe)


def rowwise_route(name: str, fn: Callable[[torch.Tensor], torch.Tensor], features: int, dtype: torch.dtype,
                  device) -> Route | None:
    """How fn, a row-wise op named `name` (log_softmax, rms_norm, silu, exp), is row-invariant on [M, features].

    Row-wise reductions and element-wise maths can still depend on M: a reduction split across threads, or a
    vectorised loop whose scalar tail rounds differently (exp, log) when M * features is not a whole number of
    SIMD steps. Chunks hold up to 4M elements (16 MB in float32, up to 4096 rows): a training batch of hidden
    states is rarely cut, and a chunk of logits stays below glibc's mmap threshold, so its temporaries reuse
    heap memory instead of faulting in fresh pages on every call (expensive on these VMs)."""
    chunks = tuple(c for c in (4096, 2048, 1024, 512, 256, 128, 64, 32) if c * features <= 1 << 22) or (32,)
    return verified(name, (features, dtype, str(device)), lambda: _route(fn, features, dtype, device, chunks))


def bmm_verified(k: int, n: int, dtype: torch.dtype, device) -> bool:
    """Is torch.bmm row-invariant here for contiguous [C, R, k] @ [C, k, n], over the row counts R in BMM_ROWS
    and any batch count C (each row's bits independent of R, of C and of the other rows of its matrix)?
    (As for GEMM, a transposed second operand takes other paths: for k >= 96 those are not row-invariant.)"""

    def probe() -> bool:
        g = torch.Generator().manual_seed(k * 7919 + n)
        count, rows = 8, max(BMM_ROWS)
        a = torch.randn(count, 2 * rows, k, generator=g).to(dtype=dtype, device=device)
        b = torch.randn(count, k, n, generator=g).to(dtype=dtype, device=device)
        reference = torch.bmm(a, b)
        for r in BMM_ROWS:
            for start in (0, rows - r // 2, 2 * rows - r):
                for c in (1, 2, 3, count):
                    got = torch.bmm(a[:c, start : start + r].clone(), b[:c])
                    if not torch.equal(got, reference[:c, start : start + r]):
                        return False
        return True

    return bool(verified("bmm", (k, n, dtype, str(device)), probe))
