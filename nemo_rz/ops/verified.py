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

Results are kept on disk for later processes (probe_cache.py: keyed by the machine and software). A loaded route
is checked once per process at a small cost (`route_holds`: a few row counts against one reference call) and
probed again if the check fails; a loaded "no" (None, or False for bmm) needs no check, as it only costs speed.

`NEMO_RZ_VERIFIED=0` turns the library routes off (fixed tiles everywhere).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from nemo_rz.ops import probe_cache

PROBE_VERSION = 1  # part of the probe cache key: bump when probe logic changes outside ops/ (edits inside re-probe anyway)
CHUNK_ROWS = (256, 128, 64)  # chunk sizes tried, largest first
MAX_MIN_ROWS = 4  # a route may pad calls up to this many rows, no more
# Row counts probed (those below the chunk size) against one call of a whole chunk: every count up to 17 (small
# decode batches, where BLAS paths change most), then both sides of the powers of two where blocking changes,
# up to the largest chunk a row-wise op may use.
PROBE_ROWS = tuple(range(1, 18)) + (23, 31, 32, 33, 47, 63, 64, 65, 96, 127, 128, 129, 191, 200, 255, 256, 257,
                                    511, 512, 513, 1000, 1023, 1024, 1025, 2047, 2048, 2049, 4095)
BMM_ROWS = (4, 8, 16, 32)  # per-matrix row counts a batched product may be called with (attention tiles)
ROWWISE_CHUNKS = (4096, 2048, 1024, 512, 256, 128, 64, 32)
ROWWISE_ELEMENTS = 1 << 22  # the most elements in one row-wise chunk
# A loaded route's check: one reference call of its chunk (or of as many rows as this many multiply-adds allow,
# at least CHECK_MIN_ROWS), then calls of fewer rows (the first always, the others while their cost stays within
# it): a few ms a shape, so that the checks of a model's routes stay a small part of a process's first forward.
CHECK_MACS = 1 << 20
CHECK_MIN_ROWS = 8

_ALIGN = 64  # bytes: the CPU allocator's alignment; a view off it is copied, so the library sees what the probe saw
_ENABLED = os.environ.get("NEMO_RZ_VERIFIED", "1") != "0"
_RESULTS: dict = {}
_LOCK = threading.RLock()  # re-entrant: a probe may need another route's result (the C++ attention's, the bmm's)


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


def by_rows(fn: Callable, x: torch.Tensor, route: Route, width: int | None = None,
            elementwise: bool = False) -> torch.Tensor:
    """fn (a row-wise map) over x [M, K] in calls of route.min_rows..route.chunk rows: fewer rows are
    zero-padded, more are cut into chunks. With `width`, fn(rows, out) writes its [rows, width] result into
    `out` (no copy; no autograd); without it, fn(rows) returns it (differentiable).

    `elementwise`: fn maps each element alone (exp, sigmoid, silu). ATen runs such maps over the whole buffer in
    SIMD steps and the last M * K % step elements through its scalar loop, whose exp rounds differently, so a
    row's bits would depend on M. Every call's row count is made a multiple of elementwise_rows(K) (zero rows):
    no element takes the scalar loop."""
    m, low_rows, chunk = x.shape[0], route.min_rows, route.chunk
    if elementwise:
        step = elementwise_rows(x.shape[1])
        low_rows, chunk = -(-low_rows // step) * step, max(step, chunk // step * step)
        if m % step:
            x = F.pad(x, (0, 0, 0, step - m % step))
    with one_thread():
        if x.shape[0] < low_rows:
            x = F.pad(x, (0, 0, 0, low_rows - x.shape[0]))
        if x.shape[0] <= chunk:
            x = _aligned(x)
            out = fn(x) if width is None else fn(x, x.new_empty(x.shape[0], width))
            return out if out.shape[0] == m else out[:m]
        total = x.shape[0]  # m, or m padded to whole element-wise steps
        if width is not None:
            out = x.new_empty(total, width)
        parts = []
        for start in range(0, total, chunk):
            stop = min(start + chunk, total)
            low = min(start, stop - low_rows)  # a short last chunk is computed inside a min_rows call ending with it
            rows = _aligned(x[low:stop])
            if width is None:
                parts.append(fn(rows)[start - low :])
            elif low == start:
                fn(rows, out[start:stop])
            else:
                out[start:stop] = fn(rows, rows.new_empty(stop - low, width))[start - low :]
        out = torch.cat(parts) if width is None else out
        return out if total == m else out[:m]


SIMD_ELEMENTS = 64  # a multiple of every ATen SIMD loop step (two AVX-512 float32 vectors: 32; AVX2: 16)


def elementwise_rows(features: int) -> int:
    """The fewest rows of `features` elements that make a whole number of SIMD_ELEMENTS."""
    return SIMD_ELEMENTS // math.gcd(features, SIMD_ELEMENTS)


def failing_rows(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, counts=PROBE_ROWS) -> list[int]:
    """The row counts M in `counts` (below C) for which fn, a row-wise map of [M, K] -> [M, N], gives some row of
    `rows` ([C, K]) other bits than one call on all C rows."""
    reference, total = fn(rows), rows.shape[0]
    bad = []
    for m in (m for m in counts if m < total):
        start = (m * 37) % (total - m + 1)  # rows from all over the reference
        # A fresh (aligned, contiguous) input, as by_rows hands the library.
        if not torch.equal(fn(rows[start : start + m].clone()), reference[start : start + m]):
            bad.append(m)
    return bad


def verified(kind: str, key: tuple, probe: Callable[[], object], check: Callable[[object], bool] | None = None):
    """probe()'s result for (kind, key), computed once per process; None where library routes are off.

    With `check` (True where a result, as read back from JSON, holds here: cheaper than the probe), the result is
    also kept on disk (probe_cache), and one found there is used once it passes the check."""
    if not _ENABLED:
        return None
    full_key = (kind, *key)
    if full_key not in _RESULTS:
        with _LOCK:
            if full_key not in _RESULTS:
                with torch.no_grad(), one_thread():
                    _RESULTS[full_key] = _probe_or_load(full_key, probe, check)
    return _RESULTS[full_key]


def _probe_or_load(full_key: tuple, probe: Callable[[], object], check: Callable[[object], bool] | None):
    if check is None or not probe_cache.enabled():
        return probe()
    machine = probe_cache.machine_key(PROBE_VERSION, torch.get_num_threads())  # (1: probes run on one thread)
    found, stored = probe_cache.lookup(full_key, machine)
    if found:
        is_route = isinstance(stored, list) and len(stored) == 2 and all(type(v) is int for v in stored)
        value = Route(*stored) if is_route else stored
        if check(value):
            return value
        probe_cache.warn(f"the stored result {stored!r} for {probe_cache.entry_name(full_key)} fails its check here; "
                         "probing again")
    value = probe()
    probe_cache.store(full_key, [value.chunk, value.min_rows] if isinstance(value, Route) else value, machine)
    return value


def _varied(rows: int, cols: int, scale: float, dtype, device) -> torch.Tensor:
    """[rows, cols] varied values, cheap to make (a short random run repeated at an odd period)."""
    run = torch.randn(4093, generator=torch.Generator().manual_seed(cols)) * scale
    total = rows * cols
    return run.repeat(-(-total // run.numel()))[:total].view(rows, cols).to(dtype=dtype, device=device)


def route_holds(make_fn: Callable[[], Callable[[torch.Tensor], torch.Tensor]], route, features: int, dtype, device,
                row_macs: int, chunks: tuple[int, ...]) -> bool:
    """Whether `route`, read back for fn = make_fn() on [M, features] rows (row_macs multiply-adds a row), is one
    the probe can give (a chunk it tries, min_rows up to MAX_MIN_ROWS) and passes a spot check: calls of min_rows
    rows (where paths change most), then top // 2 + 1 (past a power of two, where blocking changes) and
    min_rows + 1 while within CHECK_MACS, against one call of `top` rows (the chunk, or as many rows as CHECK_MACS
    allows). None (no route) always holds."""
    if route is None:
        return True
    if not (isinstance(route, Route) and route.chunk in chunks and 1 <= route.min_rows <= MAX_MIN_ROWS):
        return False
    top = min(route.chunk, max(CHECK_MIN_ROWS, CHECK_MACS // row_macs))
    counts, spent = [], 0
    for m in dict.fromkeys((route.min_rows, top // 2 + 1, route.min_rows + 1)):
        if m < top and (not counts or spent + m * row_macs <= CHECK_MACS):
            counts.append(m)
            spent += m * row_macs
    return not failing_rows(make_fn(), _varied(top, features, 4.0, dtype, device), counts)


def check_operand(operand: Callable[[], torch.Tensor] | None, k: int, n: int, dtype, device) -> torch.Tensor:
    """The [k, n] matrix a loaded GEMM route's check multiplies: the caller's operand where it is one (contiguous,
    aligned, of this dtype and device, with at least two distinct values in its first row: a constant matrix
    would hide another summation order), else varied values made for the check."""
    w_t = operand() if operand is not None else None
    if (w_t is not None and tuple(w_t.shape) == (k, n) and w_t.dtype == dtype and w_t.device == torch.device(device)
            and w_t.is_contiguous() and w_t.data_ptr() % _ALIGN == 0 and n > 1 and bool((w_t[0] != w_t[0, 0]).any())):
        return w_t
    return _varied(k, n, k ** -0.5, dtype, device)


def _on_cpu(device, check: Callable[[object], bool]) -> Callable[[object], bool] | None:
    """`check` for a CPU probe; None (not kept on disk: the machine key describes no GPU) for other devices."""
    return check if torch.device(device).type == "cpu" else None


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


def matmul_route(k: int, n: int, dtype: torch.dtype, device,
                 operand: Callable[[], torch.Tensor] | None = None) -> Route | None:
    """How torch.mm(x, w_t), x [M, k], w_t a contiguous [k, n], is row-invariant here (None: it is not).

    `operand`: the caller's own [k, n] operand (a model weight), which a loaded route's check multiplies instead
    of building a [k, n] matrix of its own (for an LM head, 113 MB of fresh memory: most of the check's cost)."""

    def probe() -> Route | None:
        g = torch.Generator().manual_seed(n)
        w_t = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype=dtype, device=device)
        return _route(lambda x: torch.mm(x, w_t), k, dtype, device)

    def product():
        w_t = check_operand(operand, k, n, dtype, device)
        return lambda x: torch.mm(x, w_t)

    check = _on_cpu(device, lambda route: route_holds(product, route, k, dtype, device, k * n, CHUNK_ROWS))
    return verified("mm", (k, n, dtype, str(device)), probe, check)


def rowwise_route(name: str, fn: Callable[[torch.Tensor], torch.Tensor], features: int, dtype: torch.dtype,
                  device) -> Route | None:
    """How fn, a row-wise op named `name` (log_softmax, rms_norm, silu, exp), is row-invariant on [M, features].

    Row-wise reductions and element-wise maths can still depend on M: a reduction split across threads, or a
    vectorised loop whose scalar tail rounds differently (exp, log) when M * features is not a whole number of
    SIMD steps. Chunks hold up to 4M elements (16 MB in float32, up to 4096 rows): a training batch of hidden
    states is rarely cut, and a chunk of logits stays below glibc's mmap threshold, so its temporaries reuse
    heap memory instead of faulting in fresh pages on every call (expensive on these VMs)."""
    chunks = tuple(c for c in ROWWISE_CHUNKS if c * features <= ROWWISE_ELEMENTS) or (ROWWISE_CHUNKS[-1],)
    check = _on_cpu(device, lambda route: route_holds(lambda: fn, route, features, dtype, device, features, chunks))
    return verified(name, (features, dtype, str(device)), lambda: _route(fn, features, dtype, device, chunks), check)


def bmm_verified(k: int, n: int, dtype: torch.dtype, device) -> bool:
    """Is torch.bmm row-invariant here for contiguous [C, R, k] @ [C, k, n], over the row counts R in BMM_ROWS
    and any batch count C (each row's bits independent of R, of C and of the other rows of its matrix)?
    (As for GEMM, a transposed second operand takes other paths: for k >= 96 those are not row-invariant.)
    The probe is cheap (about 1 ms), so a stored True is checked by probing again; a stored False is used as is."""

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

    check = _on_cpu(device, lambda ok: ok is False or (ok is True and probe()))
    return bool(verified("bmm", (k, n, dtype, str(device)), probe, check))
