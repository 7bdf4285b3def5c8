"""The C++ matrix-vector kernel (kernels/cpu/matvec.cpp) behind batch-1 decode in consistent mode: its row has
the bits the GEMM route (MKL, zero-padded to the route's min_rows) gives that row, on SmolLM2-135M's shapes and
others; ops.linear gives a row the same bits alone and in batches of 2, 8 and 64; the probe turns a kernel in
another order away; NEMO_RZ_CPP=0 and a failed build leave the pure-torch route, with at most one warning."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from nemo_rz import ops
from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.ops import gemm, probe_cache, verified
from nemo_rz.ops.verified import one_thread

# SmolLM2-135M: q/o (576->576), k/v (576->192), gate/up (576->1536), down (1536->576), LM head (576->49152);
# then odd sizes: one block, two uneven blocks, a ragged last 16 columns, Qwen2.5-0.5B's MLP.
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152), (64, 48), (385, 17), (1000, 333), (896, 4864)]

needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here")
# the block rule of the other CPU kind's MKL path (matvec.cpp): what this machine's MKL does not do
_OTHER = cpu_kernels.AVX2 if cpu_kernels.MKL_ORDER == cpu_kernels.AVX512 else cpu_kernels.AVX512


def _case(k: int, n: int, rows: int = 8):
    g = torch.Generator().manual_seed(k * 7 + n)
    weight = torch.randn(n, k, generator=g) / k ** 0.5
    return torch.randn(rows, k, generator=g) * 3.0, weight


def _route(k, n):
    route = gemm.matmul_route(k, n, torch.float32, torch.device("cpu"))
    assert route is not None, f"MKL's GEMM is not row-invariant for {k}x{n} here"
    return route


@needs_cpp
@pytest.mark.parametrize("k,n", SHAPES)
def test_cpp_equals_gemm_route(k, n):
    """Every row: C++ kernel (AVX-512 and scalar loop) == the pure-torch route (padded GEMM)."""
    x, weight = _case(k, n)
    w_t = gemm.weight_t(weight, torch.float32)
    route = _route(k, n)
    with one_thread():
        for i in range(x.shape[0]):
            row = x[i : i + 1]
            padded = gemm.routed_mm(row, w_t, route)
            assert torch.equal(cpu_kernels.matvec(row, w_t), padded)
            assert torch.equal(cpu_kernels.matvec(row, w_t, simd=False), padded)
    assert gemm.matvec_verified(k, n, route)


@needs_cpp
def test_threads_do_not_change_bits():
    """The kernel splits columns across threads; 1 and 2 threads give the same bits."""
    x, weight = _case(576, 49152, rows=1)
    w_t = gemm.weight_t(weight, torch.float32)
    with one_thread():
        one = cpu_kernels.matvec(x, w_t)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(cpu_kernels.matvec(x, w_t), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("k,n", [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)])
def test_batch_one_equals_its_row_in_batches(k, n):
    """ops.linear: a row alone (the matrix-vector route where admitted) == that row in batches of 2, 8, 64."""
    x, weight = _case(k, n, rows=64)
    full = ops.linear(x, weight)
    for m in (2, 8):
        assert torch.equal(ops.linear(x[:m], weight), full[:m])
    for i in (0, 1, 31, 63):
        assert torch.equal(ops.linear(x[i : i + 1], weight), full[i : i + 1])
    if cpu_kernels.available():
        assert gemm.matvec_verified(k, n, _route(k, n))  # the C++ route was the one taken


@needs_cpp
@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576)])
def test_negative_control_other_orders_differ(k, n):
    """MKL's own 1-row path (gemv, unpadded) and the kernel with other block sizes give other bits: the order
    matters, and the tests above would see a wrong one."""
    x, weight = _case(k, n, rows=1)
    w_t = gemm.weight_t(weight, torch.float32)
    with one_thread():
        reference = gemm.routed_mm(x, w_t, _route(k, n))
        assert not torch.equal(torch.mv(w_t.t(), x[0])[None], reference)
        assert not torch.equal(torch.mm(x, w_t), reference)
        for block in (64, 128, 256, k):
            assert not torch.equal(cpu_kernels.matvec(x, w_t, block=block), reference), block
        # the block rule of the other CPU kind's MKL code path (AVX-512 vs AVX2) is another order too
        assert not torch.equal(cpu_kernels.matvec(x, w_t, order=_OTHER), reference)


@needs_cpp
@pytest.mark.parametrize("other", [{"block": 256}, {"order": _OTHER}], ids=["block256", "other_cpu_kind"])
def test_negative_control_probe_rejects_reordered_kernel(monkeypatch, tmp_path, other):
    """A kernel in another order (256-row blocks; the rule of the other CPU kind's MKL path, as the AVX-512 rule
    is on an AVX2-only CPU) fails the probe, and ops.linear keeps the padded GEMM, row-invariant."""
    k, n = 576, 1536
    _fresh_cache(monkeypatch, tmp_path)  # (so that the probe runs, not a stored answer)
    monkeypatch.setattr(cpu_kernels, "build_tag", lambda: f"reordered-{other}")
    matvec = cpu_kernels.matvec
    monkeypatch.setattr(cpu_kernels, "matvec", lambda x, w_t: matvec(x, w_t, **other))
    assert not gemm.matvec_verified(k, n, _route(k, n))
    x, weight = _case(k, n, rows=8)
    assert torch.equal(ops.linear(x[:1], weight), ops.linear(x, weight)[:1])


def _fresh_cache(monkeypatch, directory):
    """A new process's view with an empty probe cache in `directory`."""
    monkeypatch.setenv("NEMO_RZ_CACHE_DIR", str(directory))
    monkeypatch.delenv("NEMO_RZ_PROBE_CACHE", raising=False)
    monkeypatch.setattr(verified, "_ENABLED", True)
    monkeypatch.setattr(verified, "_RESULTS", {})
    monkeypatch.setattr(probe_cache, "_files", {})
    monkeypatch.setattr(probe_cache, "_warned", False)


@needs_cpp
def test_the_answer_is_kept_on_disk_and_checked_on_load(monkeypatch, tmp_path, capfd):
    """A later process reads the probe's answer (one checked row instead of MATVEC_PROBE_ROWS). Negative control:
    with the kernel reordered under the same build tag, the stored True fails its check, the probe runs again and
    says no."""
    k, n = 576, 1536
    _fresh_cache(monkeypatch, tmp_path)
    route = _route(k, n)
    calls = []
    matvec = cpu_kernels.matvec
    monkeypatch.setattr(cpu_kernels, "matvec", lambda x, w_t, block=None: calls.append(1) or matvec(x, w_t, block))
    assert gemm.matvec_verified(k, n, route) and len(calls) == gemm.MATVEC_PROBE_ROWS
    stored = json.loads(next(tmp_path.glob("probes-*.json")).read_text())["entries"]
    assert [v for name, v in stored.items() if json.loads(name)[0] == "matvec"] == [True]

    monkeypatch.setattr(verified, "_RESULTS", {})
    monkeypatch.setattr(probe_cache, "_files", {})
    calls.clear()
    assert gemm.matvec_verified(k, n, route) and len(calls) == 1

    monkeypatch.setattr(verified, "_RESULTS", {})
    monkeypatch.setattr(probe_cache, "_files", {})
    monkeypatch.setattr(cpu_kernels, "matvec", lambda x, w_t: matvec(x, w_t, block=256))
    assert not gemm.matvec_verified(k, n, route)
    assert "fails its check" in capfd.readouterr().err


@needs_cpp
def test_a_finished_build_loads_straight_and_a_changed_library_is_refused(tmp_path):
    """A later process loads the library its marker vouches for without cpp_extension. Negative controls: a copy
    whose bytes differ from the recorded digest, a symlinked library and a missing marker are not loaded that way."""
    tag, where = cpu_kernels._build_dir()
    name = f"nemo_rz_cpu_{tag}"
    assert cpu_kernels._load_built(where, name)  # (this process loaded the same file already: no second registration)
    lib = (where / f"{name}.so").read_bytes()
    other = tmp_path / "other"
    other.mkdir()
    (other / f"{name}.so").write_bytes(lib[:-1] + bytes([lib[-1] ^ 1]))
    (other / cpu_kernels._MARK).write_text((where / cpu_kernels._MARK).read_text())
    assert not cpu_kernels._load_built(other, name)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / f"{name}.so").symlink_to(where / f"{name}.so")
    (linked / cpu_kernels._MARK).write_text((where / cpu_kernels._MARK).read_text())
    assert not cpu_kernels._load_built(linked, name)
    (other / f"{name}.so").write_bytes(lib)
    (other / cpu_kernels._MARK).unlink()
    assert not cpu_kernels._load_built(other, name)


_FALLBACK = """
import warnings, torch
from nemo_rz import ops
from nemo_rz.kernels import cpu
from nemo_rz.ops import gemm
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    available = cpu.available()
    w = torch.randn(1536, 576); x = torch.randn(8, 576)
    with ops.use_kernels("consistent"):
        ok = torch.equal(ops.linear(x[:1], w), ops.linear(x, w)[:1])
        route = gemm.matmul_route(576, 1536, torch.float32, x.device)
        admitted = gemm.matvec_verified(576, 1536, route)
print(available, admitted, ok, len([c for c in caught if "C++" in str(c.message)]))
"""


@pytest.mark.parametrize("env,warnings", [({"NEMO_RZ_CPP": "0"}, 0), ({"CXX": "false", "NEMO_RZ_CPP": "1"}, 1)])
def test_fallback_without_cpp(tmp_path, env, warnings):
    """NEMO_RZ_CPP=0 (no build, no warning) and a compiler that fails (one warning): the pure-torch route, same bits."""
    run_env = {**os.environ, "NEMO_RZ_CACHE_DIR": str(tmp_path), **env}
    out = subprocess.run([sys.executable, "-c", _FALLBACK], env=run_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True", str(warnings)], out.stdout + out.stderr[-2000:]
