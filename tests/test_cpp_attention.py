"""The C++ consistent attention forward (kernels/cpu/attention.cpp) gives the tiled ATen path's bits: decode,
chunked and whole prefill, batch 1..64, GQA ratios, head_dim 64/128, windows, sinks, contiguous and paged caches,
float32 and bfloat16 caches, AVX-512 and scalar loops, 1 and 2 threads. ops.attention takes it without autograd
only; NEMO_RZ_CPP=0 keeps the tiled path. Negative controls: fast mode's library attention (another order) has
other bits, and the probe turns a kernel in another order away."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from nemo_rz import ops
from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.ops import probe_cache, verified
from nemo_rz.ops.attention_plan import AttentionPlan

A = importlib.import_module("nemo_rz.ops.attention")  # (nemo_rz.ops.attention is also the function's name)

needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here")
SCALE = 0.125


def _case(lens, new, heads, kv_heads, dim, paged=False, dtype=torch.float32, sinks=False, seed=0, slots=None):
    """Tokens: the last new[s] positions of each sequence s of length lens[s]; random caches (contiguous
    [S, Hkv, slots, D], or the same keys in shuffled 64-key pages of a paged cache whose unused pages hold NaN)."""
    g = torch.Generator().manual_seed(seed)
    slots = slots or (max(lens) + 31) // 32 * 32
    seq_idx = torch.cat([torch.full((n,), s) for s, n in enumerate(new)])
    positions = torch.cat([torch.arange(length - n, length) for length, n in zip(lens, new)])
    q = torch.randn(seq_idx.shape[0], heads, dim, generator=g) * 2.0
    k = torch.randn(len(lens), kv_heads, slots, dim, generator=g).to(dtype)
    v = torch.randn(len(lens), kv_heads, slots, dim, generator=g).to(dtype)
    table = None
    if paged:
        block, per_seq = 64, (slots + 63) // 64
        table = torch.randperm(len(lens) * per_seq + 2, generator=g)[: len(lens) * per_seq].view(len(lens), per_seq)
        pages = []
        for c in (k, v):
            page = torch.full((len(lens) * per_seq + 2, kv_heads, block, dim), float("nan")).to(dtype)
            for s in range(len(lens)):
                for j in range(per_seq):
                    n = min(block, slots - j * block)
                    page[table[s, j], :, :n] = c[s, :, j * block : j * block + n]
            pages.append(page)
        k, v = pages
    sink = torch.randn(heads, generator=g) if sinks else None
    return q, k, v, seq_idx, positions, table, sink


def _both(q, k, v, seq_idx, positions, table, sink, window=None, simd=True):
    """(C++ forward, tiled ATen path) for one call."""
    plan = AttentionPlan(seq_idx, positions, q.shape[1], k.shape[1])
    with torch.no_grad():
        want = A._attention_tiled(q, k, v, SCALE, table, plan.tiled(q.shape[-1], torch.float32, window), sink)
        s, p, first = plan.starts(window)
        got = cpu_kernels.attention_fwd(q.float().contiguous(), k, v, s, p, first, table,
                                        None if sink is None else sink.float(), SCALE, simd)
    return got.to(q.dtype), want


SHAPES = [  # (lens, new): decode, chunked prefill, whole prompts, a mix
    ([300], [1]),
    ([5, 40, 33, 64, 65, 100, 1, 200], [1] * 8),
    ([(7 * i) % 150 + 1 for i in range(64)], [1] * 64),
    ([50, 70, 33], [50, 70, 33]),
    ([50, 90, 33], [10, 30, 1]),
]


@needs_cpp
@pytest.mark.parametrize("lens,new", SHAPES, ids=["b1", "b8", "b64", "prefill", "chunked"])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (8, 1, 64)])
def test_equals_tiled(lens, new, heads, kv_heads, dim):
    for paged in (False, True):
        got, want = _both(*_case(lens, new, heads, kv_heads, dim, paged=paged))
        assert torch.equal(got, want), f"paged={paged}: {(got != want).sum()} of {got.numel()} differ"


@needs_cpp
@pytest.mark.parametrize("window,sinks,dtype", [(40, False, torch.float32), (None, True, torch.float32),
                                                (37, True, torch.float32), (None, False, torch.bfloat16),
                                                (20, True, torch.bfloat16)])
def test_windows_sinks_bf16(window, sinks, dtype):
    for paged in (False, True):
        for lens, new in SHAPES[1:]:
            case = _case(lens, new, 8, 2, 64, paged=paged, dtype=dtype, sinks=sinks, seed=3)
            for simd in (True, False):
                got, want = _both(*case, window=window, simd=simd)
                assert torch.equal(got, want), f"paged={paged} simd={simd} lens={lens}"


@needs_cpp
def test_ring_cache_and_threads():
    """A contiguous cache with fewer slots than positions (sliding-window ring), and 2 threads vs 1."""
    case = _case([100, 90, 70], [1, 1, 5], 4, 2, 64, slots=64)
    got, want = _both(*case, window=30)
    assert torch.equal(got, want)
    case = _case(*SHAPES[2], 9, 3, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one, _ = _both(*case)
    finally:
        torch.set_num_threads(max(threads, 2))
    try:
        two, want = _both(*case)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, want)


@needs_cpp
def test_ops_attention_takes_it_without_grad_only(monkeypatch):
    """ops.attention: no autograd -> the C++ forward (a spy sees it), same bits as the tiled path; q requiring
    grad -> the tiled path, and gradients flow."""
    q, k, v, seq_idx, positions, table, sink = _case(*SHAPES[4], 9, 3, 64, paged=True)
    calls = []
    real = A._attention_cpp
    monkeypatch.setattr(A, "_attention_cpp", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out = ops.attention(q, k, v, seq_idx, positions, SCALE, block_table=table)
    assert calls and torch.equal(out, _both(q, k, v, seq_idx, positions, table, None)[1])
    calls.clear()
    qg = q.clone().requires_grad_()
    out_g = ops.attention(qg, k, v, seq_idx, positions, SCALE, block_table=table)
    assert not calls and torch.equal(out_g.detach(), out)
    out_g.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


@needs_cpp
def test_negative_controls(monkeypatch):
    """Fast mode's attention (SDPA: another summation order) differs from these bits; a kernel that sums the key
    blocks in another order (fast mode standing in for it) fails the probe, so ops.attention would not use it."""
    q, k, v, seq_idx, positions, table, sink = _case(*SHAPES[1], 9, 3, 64)
    got, _ = _both(q, k, v, seq_idx, positions, table, None)
    with ops.use_kernels("fast"), torch.no_grad():
        fast = ops.attention(q, k, v, seq_idx, positions, SCALE)
    assert not torch.equal(got, fast) and torch.allclose(got, fast, atol=1e-4)
    assert A._cpp_probe(64, torch.float32)

    def other_order(q, k, v, s, p, first, table, sinks, scale, simd=True):
        plan = AttentionPlan(s, p, q.shape[1], k.shape[1])
        window = None if bool((first == 0).all()) else 24
        with ops.use_kernels("fast"):
            return ops.attention(q, k, v, s, p, scale, window, table, plan, sinks)

    monkeypatch.setattr(cpu_kernels, "attention_fwd", other_order)
    assert not A._cpp_probe(64, torch.float32)


@needs_cpp
@pytest.mark.skipif(not verified._ENABLED, reason="NEMO_RZ_VERIFIED=0")
def test_the_probe_is_kept_on_disk_and_checked_on_load(tmp_path, monkeypatch):
    """A new process reads the probe's result from disk; a stored True that fails its load check (the C++ forward
    broken on purpose: the negative control) is probed again, here to False."""
    monkeypatch.setenv("NEMO_RZ_CACHE_DIR", str(tmp_path))
    key = ("attention_cpp", 64, str(torch.float32), cpu_kernels.build_tag())
    machine = probe_cache.machine_key(verified.PROBE_VERSION, 1)

    def fresh():
        monkeypatch.setattr(A, "_CPP_VERIFIED", {})
        monkeypatch.setattr(verified, "_RESULTS", {k: v for k, v in verified._RESULTS.items() if k != key})
        return A.cpp_verified(64, torch.float32)

    assert fresh() and probe_cache.lookup(key, machine) == (True, True)
    probes = []
    monkeypatch.setattr(A, "_cpp_agrees", lambda q, caches, calls: probes.append(len(calls)) or True)
    assert fresh() and probes == [1]  # loaded: one call checked, not the probe's three

    real = cpu_kernels.attention_fwd
    monkeypatch.undo()
    monkeypatch.setenv("NEMO_RZ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "attention_fwd", lambda *a, **kw: real(*a, **kw) + 1e-7)
    assert not fresh() and probe_cache.lookup(key, machine) == (True, False)


@needs_cpp
def test_bad_input_one_line():
    q, k, v, seq_idx, positions, table, _ = _case(*SHAPES[1], 9, 3, 64, paged=True)
    with pytest.raises(RuntimeError, match="outside the block table"):
        cpu_kernels.attention_fwd(q, k, v, seq_idx, positions + 10_000, torch.zeros_like(positions), table, None, SCALE)


def test_fallback_without_cpp(tmp_path):
    """NEMO_RZ_CPP=0: no C++ kernels, ops.attention on the tiled path, with this process's bits."""
    q, k, v, seq_idx, positions, table, sink = _case(*SHAPES[4], 8, 2, 64, paged=True, sinks=True)
    torch.save((q, k, v, seq_idx, positions, table, sink), tmp_path / "case.pt")
    code = (
        "import json, sys, torch\n"
        "import importlib\nfrom nemo_rz import ops\nfrom nemo_rz.kernels import cpu\n"
        "A = importlib.import_module('nemo_rz.ops.attention')\n"
        f"q, k, v, s, p, t, sink = torch.load({str(tmp_path / 'case.pt')!r})\n"
        "with torch.no_grad():\n"
        "    out = ops.attention(q, k, v, s, p, 0.125, None, t, None, sink)\n"
        f"torch.save(out, {str(tmp_path / 'out.pt')!r})\n"
        "print(json.dumps([cpu.available(), A.cpp_verified(64, torch.float32)]))\n"
    )
    env = dict(os.environ, NEMO_RZ_CPP="0")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [False, False]
    with torch.no_grad():
        here = ops.attention(q, k, v, seq_idx, positions, SCALE, None, table, None, sink)
    assert torch.equal(torch.load(tmp_path / "out.pt"), here)
    if cpu_kernels.available() and verified._ENABLED:
        assert A.cpp_verified(64, torch.float32)
