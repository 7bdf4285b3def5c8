"""Library kernels proven row-invariant on this machine, by a probe at first use.

The fixed row tiles (tiles.py) are row-invariant by construction, but cost one small BLAS product per 32 rows
(and a slow backward). Some platform kernels are row-invariant by themselves: with one thread, MKL's float32
GEMM gives a row the same bits for every row count M >= 4 at every position (torch 2.13 CPU, AVX-512), and
ATen's last-dim log_softmax computes each row alone. That is a property of the BLAS build, the CPU and the
thread count, not a promise, so nemo_rz uses a library kernel only after a probe on this machine has compared,
bit for bit, every row of calls over a spread of row counts against one reference call of a chunk of rows.
GEMM calls are then never larger than that chunk nor smaller than MIN_ROWS (padded), so every row count that
can occur lies in the probed range. A shape that fails its probe, or a thread count other than one, keeps the
fixed tiles. (MKL's GEMM is row-invariant only with the weight as a contiguous [K, N] matrix: with the
transposed view of a [N, K] Linear weight, calls of up to 15 rows take another path.)

`NEMO_RZ_VERIFIED=0` turns the library routes off (fixed tiles everywhere).
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch

MIN_ROWS = 4  # MKL takes other paths for 1-3 rows (checked): smaller calls are zero-padded to 4
# Calls larger than a chunk of rows are cut into chunks. MKL switches GEMM paths at some row count that depends
# on the shape (e.g. between 128 and 200 rows for K=4864, N=896): the largest chunk size whose probe passes is used.
CHUNK_ROWS = (256, 128, 64)
# Row counts probed (those below the chunk size) against one call of a whole chunk: every count up to 17 (small
# decode batches, where BLAS paths change most), then both sides of the powers of two where blocking changes.
PROBE_ROWS = tuple(range(MIN_ROWS, 18)) + (23, 31, 32, 33, 47, 63, 64, 65, 96, 127, 128, 129, 191, 200, 255)

_ENABLED = os.environ.get("NEMO_RZ_VERIFIED", "1") != "0"
_RESULTS: dict = {}
_LOCK = threading.Lock()


def rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor) -> bool:
    """Does fn (a row-wise map of [M, K] -> [M, N]) give each row of `rows` ([C, K]) the same bits for every
    probed row count below C and every offset as in one call on all C rows?"""
    reference, total = fn(rows), rows.shape[0]
    for m in (m for m in PROBE_ROWS if m < total):
        start = (m * 37) % (total - m + 1)  # rows from all over the reference
        # A fresh (aligned, contiguous) input, as the routed callers hand the library.
        if not torch.equal(fn(rows[start : start + m].clone()), reference[start : start + m]):
            return False
    return True


def verified(kind: str, key: tuple, probe: Callable[[], bool]) -> bool:
    """True if the library route for (kind, key) passed its probe in this process (run once, on first ask)."""
    if not _ENABLED or torch.get_num_threads() != 1:
        return False
    full_key = (kind, *key)
    ok = _RESULTS.get(full_key)
    if ok is None:
        with _LOCK:
            ok = _RESULTS.get(full_key)
            if ok is None:
                with torch.no_grad():
                    ok = _RESULTS[full_key] = bool(probe())
    return ok


def _probe_rows(rows: int, k: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    return torch.randn(rows, k, generator=g).to(dtype=dtype, device=device)


def matmul_chunk_rows(k: int, n: int, dtype: torch.dtype, device) -> int:
    """The largest chunk size C in CHUNK_ROWS for which torch.mm(x, w_t), x [M, k], w_t a contiguous [k, n],
    is row-invariant here for MIN_ROWS <= M <= C; 0 if none is (then the fixed tiles are used)."""
    for chunk in CHUNK_ROWS:

        def probe() -> bool:
            g = torch.Generator().manual_seed(n)
            w_t = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype=dtype, device=device)
            return rows_invariant(lambda x: torch.mm(x, w_t), _probe_rows(chunk, k, dtype, device))

        if verified("mm", (k, n, chunk, dtype, str(device)), probe):
            return chunk
    return 0


def log_softmax_verified(v: int, dtype: torch.dtype, device) -> bool:
    """Is torch.log_softmax(x, -1) row-invariant here for x [M, v]?"""

    def probe() -> bool:
        return rows_invariant(lambda x: torch.log_softmax(x, -1), _probe_rows(CHUNK_ROWS[0], v, dtype, device) * 4.0)

    return verified("log_softmax", (v, dtype, str(device)), probe)


BMM_ROWS = (4, 8, 16, 32)  # per-matrix row counts a batched product may be called with (attention tiles)


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

    return verified("bmm", (k, n, dtype, str(device)), probe)
