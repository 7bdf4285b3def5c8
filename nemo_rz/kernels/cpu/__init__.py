"""C++ CPU kernels (packaged as ``nemo_rz.kernels.cpu``), compiled at first use with torch's cpp_extension.

The sources ship in this folder; the build goes to `$NEMO_RZ_CACHE_DIR/torch_extensions` (default
`~/.cache/nemo_rz/torch_extensions`), in a folder named after the sources, the compiler flags, torch's version
and this CPU (a `-march=native` build never runs on another kind of CPU). It is built once per machine; later
processes only load it (straight from the library a finished build left, checked against the digest recorded
beside it: no cpp_extension import, no ninja run). No compiler, a failed build or `NEMO_RZ_CPP=0`:
`available()` is False (with one warning line for a failed build) and callers keep their pure-torch route.

- `matvec(x, w_t)`: x [1, K] @ w_t [K, N] (float32, w_t contiguous) in a fixed order (matvec.cpp), which is the
  order MKL's single-thread GEMM gives each row of a product of two or more rows on this CPU's kind: MKL cuts K
  into blocks by one rule on its AVX-512 path (Intel CPUs only) and another on AVX2 (MKL_ORDER, from the CPU's
  vendor and flags). Whether it is, on a given machine and shape, is for the caller to probe (ops/gemm.py does).
- `rows_mm(x, w_t)`: x [M, K] float32 @ w_t [K, N] (float32 or bfloat16, contiguous) with every row in that same
  order, whatever M: a bfloat16 weight is read as it is stored (half the bytes of a float32 copy) and gives the
  bits of its exact float32 widening; rows share each pass over the weight, up to 8 at a time.
- `attention_fwd(...)`: the forward of ops.attention's consistent tiled path (attention.cpp), reading keys and
  values straight from a contiguous or paged cache; whether it gives that path's bits here is for the caller to
  probe (ops/attention.py does).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import threading
import warnings
from pathlib import Path

import torch

from nemo_rz import atomic

AVX512, AVX2 = 0, 1  # matvec.cpp's block rules: the orders MKL's sgemm takes on those code paths
BLOCKS = {AVX512: 384, AVX2: 192}  # rows of w_t per accumulator block in each rule
_SOURCES = ("matvec.cpp", "attention.cpp")
_MARK = "built.sha256"  # written after a finished build: the digest of the library it left
_FLAGS = ("-O3", "-march=native", "-std=c++17")
_LOCK = threading.Lock()
_UNLOADED = object()
_TAG: object = _UNLOADED  # what _load gave, once it ran


def _cpu_id() -> str:
    """What a -march=native binary (and MKL's choice of code path) depends on: the architecture and the CPU's
    vendor, model and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("vendor_id", "model name", "flags", "Features")):
                    lines.append(line)
                if len(lines) >= 3:
                    break
    except OSError:
        pass
    return platform.machine() + "".join(lines)


def _mkl_order() -> int:
    """The block rule of the code path MKL takes here: AVX-512 on Intel CPUs that have it (avx512f), else AVX2.
    MKL dispatches by vendor: on AMD CPUs with AVX-512 (Zen 4) its sgemm takes the AVX2 path."""
    cpu = _cpu_id()
    return AVX512 if "GenuineIntel" in cpu and " avx512f" in cpu else AVX2


MKL_ORDER = _mkl_order()
MKL_BLOCK = BLOCKS[MKL_ORDER]  # rows of w_t per accumulator block in this machine's order


def _build_dir() -> tuple[str, Path]:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    h.update(repr((_FLAGS, torch.__version__, platform.python_version(), _cpu_id())).encode())
    tag = h.hexdigest()[:16]
    base = Path(os.environ.get("NEMO_RZ_CACHE_DIR") or Path.home() / ".cache" / "nemo_rz")
    return tag, base / "torch_extensions" / f"nemo_rz_cpu_{tag}"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _registered() -> None:
    """Raise AttributeError unless every op of the sources is registered."""
    ops = torch.ops.nemo_rz_cpu
    ops.matvec, ops.rows_mm, ops.attention_fwd  # noqa: B018


def _load_built(where: Path, name: str) -> bool:
    """Load the library a finished build left in `where` without importing cpp_extension or running ninja (most
    of a warm process's cost here: ~0.8 s wall): only a regular file of this user whose digest the build's
    marker records (a build still being written, or a file replaced since, is built again)."""
    lib, mark = where / f"{name}.so", where / _MARK
    try:
        st = os.lstat(lib)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or mark.read_text().strip() != _digest(lib):
            return False
        torch.ops.load_library(str(lib))
        _registered()
    except (OSError, RuntimeError, AttributeError):
        return False
    return True


def _load() -> str | None:
    """Build (once per machine) and load the extension; its build tag, or None where it cannot be had."""
    if os.environ.get("NEMO_RZ_CPP", "1") == "0":
        return None
    tag, where = _build_dir()
    name = f"nemo_rz_cpu_{tag}"
    if _load_built(where, name):
        return tag
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++")):
        return None
    try:
        from torch.utils import cpp_extension

        where.mkdir(parents=True, exist_ok=True)
        here = Path(__file__).resolve().parent
        cpp_extension.load(name, [str(here / s) for s in _SOURCES], extra_cflags=list(_FLAGS),
                           build_directory=str(where), is_python_module=False, verbose=False)
        _registered()
    except Exception as e:  # a missing ninja, a compiler error, an unwritable cache: the pure-torch route stays
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        warnings.warn(f"nemo_rz: C++ CPU kernels unavailable ({first}); using the pure-torch routes "
                      "(NEMO_RZ_CPP=0 skips the build)", stacklevel=3)
        return None
    try:
        atomic.write_text(where / _MARK, _digest(where / f"{name}.so"))
    except OSError:
        pass  # later processes go through cpp_extension, as before
    return tag


def build_tag() -> str | None:
    """The loaded build's tag (sources, flags, torch, CPU), or None where there is none (building it on the first
    call): part of any cached fact about its results."""
    global _TAG
    if _TAG is _UNLOADED:
        with _LOCK:
            if _TAG is _UNLOADED:
                _TAG = _load()
    return _TAG


def available() -> bool:
    """Are the C++ kernels built and loaded (building them on the first call)?"""
    return build_tag() is not None


def matvec(x: torch.Tensor, w_t: torch.Tensor, block: int | None = None, simd: bool = True,
           order: int | None = None) -> torch.Tensor:
    """x [1, K] @ w_t [K, N] -> [1, N], float32 on CPU, in matvec.cpp's fixed order: rule `order` (AVX512 or
    AVX2; default MKL_ORDER) with `block`-row blocks (default that rule's BLOCKS entry; another size is another
    order); simd=False runs the scalar loop that CPUs without AVX-512 run. Call only where `available()`."""
    order = MKL_ORDER if order is None else order
    return torch.ops.nemo_rz_cpu.matvec(x, w_t, BLOCKS[order] if block is None else block, simd, order)


def rows_mm(x: torch.Tensor, w_t: torch.Tensor, block: int | None = None, simd: bool = True,
            order: int | None = None) -> torch.Tensor:
    """x [M, K] float32 @ w_t [K, N] (float32 or bfloat16) -> [M, N] float32 on CPU, each row in matvec's order
    (the bits of matvec on that row and w_t widened to float32; `block` and `order` as there). Call only where
    `available()`."""
    order = MKL_ORDER if order is None else order
    return torch.ops.nemo_rz_cpu.rows_mm(x, w_t, BLOCKS[order] if block is None else block, simd, order)


def attention_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_idx: torch.Tensor,
                  positions: torch.Tensor, starts: torch.Tensor, block_table: torch.Tensor | None,
                  sinks: torch.Tensor | None, scale: float, simd: bool = True) -> torch.Tensor:
    """Causal GQA attention forward (attention.cpp): q [N, H, D] float32 (contiguous); caches [S, Hkv, L, D]
    (block_table None) or [num_blocks, Hkv, block_size, D] (block_table [S, max_blocks] int64), float32 or
    bfloat16, unit stride along D; seq_idx, positions and starts (each token's first visible key) int64 [N];
    sinks [H] float32 or None -> [N, H, D] float32. simd=False runs the scalar loops. Call only where
    `available()`."""
    return torch.ops.nemo_rz_cpu.attention_fwd(q, k_cache, v_cache, seq_idx, positions, starts, block_table, sinks,
                                               scale, simd)
