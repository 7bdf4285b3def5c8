"""Triton kernels (nemo_rz.kernels): correctness against float64 and bitwise batch invariance.

On CPU these run under the Triton interpreter (TRITON_INTERPRET=1, set here before Triton is imported);
with TRITON_INTERPRET=0 and a GPU they run on CUDA. Every invariance check has a negative control that
changes the reduction order on purpose and must make the same check fail.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch  # noqa: E402
from conftest import interpreter_dot_row_invariant, skip_unless_dot_row_invariant  # noqa: E402

from nemo_rz import kernels  # noqa: E402
from nemo_rz.kernels import window_start  # noqa: E402

pytestmark = pytest.mark.kernels

INTERPRET = os.environ["TRITON_INTERPRET"].strip().lower() in ("1", "true", "on", "yes")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and no CUDA device", allow_module_level=True)
DEV = "cpu" if INTERPRET else "cuda"
RTOL = 1e-5


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(DEV)


def rel_err(out, ref):
    """Max abs error over max abs reference value (finite entries)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(out))
    return ((out - ref)[fin].abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()


def rows_identical(fn, x, subsets):
    """fn(x[idx]) row i == fn(x)[idx[i]] bitwise, for every index list idx in subsets."""
    full = fn(x)
    return all(torch.equal(fn(x[idx]), full[idx]) for idx in subsets)


def test_interpreter_dot_check_sees_a_row_dependent_dot(monkeypatch):
    """Negative control for the skip above: a matmul that rounds a row by its tile's other rows is caught."""
    if not INTERPRET:
        pytest.skip("the check is the interpreter's")
    import numpy as np

    real = np.matmul
    monkeypatch.setattr(np, "matmul", lambda a, b, **kw: real(a, b, **kw) * (1 + 1e-7 * (np.abs(a).sum() > 50)))
    assert not interpreter_dot_row_invariant(16, 16, 16)


def batch_subsets(M, seed=0):
    g = gen(seed)
    perm = torch.randperm(M, generator=g)
    return [
        torch.tensor([0]), torch.tensor([M - 1]), torch.arange(3, 6), torch.arange(1, M),
        perm, perm[: M // 2 + 1], torch.tensor([M - 1] + list(range(M - 1))),
    ]


# ---------------------------------------------------------------------------------------------- window
def test_window_start_int_and_tensor():
    assert window_start(5, None) == 0
    assert window_start(5, 3) == 3 and window_start(1, 3) == 0 and window_start(2, 3) == 0
    assert window_start(7, 1) == 7
    p = torch.arange(8)
    assert torch.equal(window_start(p, 3), torch.tensor([0, 0, 0, 1, 2, 3, 4, 5]))
    assert torch.equal(window_start(p, None), torch.zeros(8, dtype=torch.long))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            window_start(3, bad)


def test_package_import_does_not_import_triton():
    code = "import sys, nemo_rz.kernels as k; k.window_start(3, 2); assert 'triton' not in sys.modules"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_attention_name_stays_the_function_after_submodule_import():
    import importlib

    sub = importlib.import_module("nemo_rz.kernels.causal_attention")
    assert kernels.attention is sub.attention and sub.KV_BLOCK == kernels.KV_BLOCK


# ---------------------------------------------------------------------------------------------- matmul
def test_linear_matches_float64():
    for (M, N, K), bias in (((37, 200, 130), True), ((5, 96, 80), False), ((1, 17, 33), True)):
        x, w = randn(M, K, seed=1), randn(N, K, seed=2)
        b = randn(N, seed=3) if bias else None
        ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        assert rel_err(kernels.linear(x, w, b), ref) < RTOL


def test_tile_config_ignores_m():
    import inspect

    from nemo_rz.kernels.matmul import tile_config

    assert list(inspect.signature(tile_config).parameters) == ["dtype", "N", "K"]


def test_linear_batch_invariant_and_controls():
    from nemo_rz.kernels.matmul import TileConfig, _linear, tile_config

    M, N, K = 300, 64, 96  # three 128-row tiles
    skip_unless_dot_row_invariant(tile_config(torch.float32, N, K))
    x, w, b = randn(M, K, seed=4), randn(N, K, seed=5), randn(N, seed=6)
    subsets = batch_subsets(M)
    assert rows_identical(lambda a: kernels.linear(a, w, b), x, subsets)

    # control 1: a tile config that looks at M (a smaller K block for small batches) changes the order
    def by_m(dtype, n, k, m):
        good = tile_config(dtype, n, k)
        return TileConfig(good.block_m, good.block_n, 16 if m < 64 else good.block_k)

    assert not rows_identical(lambda a: _linear(a, w, b, by_m), x, subsets)

    # control 2: split-K (two K halves reduced separately, then summed) differs from the one-pass kernel
    h = K // 2
    split = kernels.linear(x[:, :h].contiguous(), w[:, :h].contiguous(), b) + kernels.linear(
        x[:, h:].contiguous(), w[:, h:].contiguous()
    )
    assert not torch.equal(split, kernels.linear(x, w, b))


def test_linear_strided_rows():
    x, w = randn(20, 64, seed=7), randn(48, 32, seed=8)
    view = x[:, 16:48]  # row stride 64, last dim contiguous
    assert torch.equal(kernels.linear(view, w), kernels.linear(view.contiguous(), w))


def test_linear_validation():
    x, w = randn(4, 8), randn(6, 8)
    with pytest.raises(ValueError, match="but weight is"):
        kernels.linear(x, randn(6, 9))
    with pytest.raises(ValueError, match="linear: weight dtype"):
        kernels.linear(x, w.double())
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kernels.linear(x, randn(8, 6).t())
    with pytest.raises(ValueError, match="2-D"):
        kernels.linear(x[None], w)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.linear(x, w, randn(5))


def test_cpu_tensors_need_interpreter(monkeypatch):
    if not INTERPRET:
        pytest.skip("interpreter not in use")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA tensors"):
        kernels.linear(randn(4, 8), randn(6, 8))


# ---------------------------------------------------------------------------------------------- rmsnorm
def rms_ref(x, w, eps):
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def test_rms_norm_matches_float64_and_is_invariant():
    for H in (200, 5000):  # one masked block; two blocks of 4096
        x, w = randn(9, H, seed=10, scale=3.0), randn(H, seed=11)
        assert rel_err(kernels.rms_norm(x, w, 1e-6), rms_ref(x, w, 1e-6)) < RTOL
        assert rows_identical(lambda a: kernels.rms_norm(a, w, 1e-6), x, batch_subsets(9))


def test_rms_norm_control_block_size_changes_bits():
    # The check can fail: a different H block (what an M-dependent choice would do) changes the sum order.
    from nemo_rz.kernels import rmsnorm

    x = randn(16, 5000, seed=12) * torch.exp(2 * randn(16, 5000, seed=14))  # wide range: rounding shows
    w = randn(5000, seed=13)
    ref = kernels.rms_norm(x, w, 1e-6)
    y = torch.empty_like(x)
    rmsnorm._rms_norm_kernel[(16,)](x, w, y, 5000, x.stride(0), 1e-6, BLOCK_H=1024)
    assert rel_err(y, ref) < RTOL and not torch.equal(y, ref)


def test_rms_norm_validation():
    with pytest.raises(ValueError, match="rms_norm: weight is"):
        kernels.rms_norm(randn(3, 8), randn(7), 1e-6)
    with pytest.raises(ValueError, match="eps"):
        kernels.rms_norm(randn(3, 8), randn(8), -1.0)


# ---------------------------------------------------------------------------------------------- silu
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(1e4) in the interpreter
def test_silu_and_mul_matches_float64_and_is_invariant():
    g, u = randn(11, 3000, seed=20, scale=4.0), randn(11, 3000, seed=21)
    gd = g.double()
    assert rel_err(kernels.silu_and_mul(g, u), gd / (1 + torch.exp(-gd)) * u.double()) < RTOL
    subsets = batch_subsets(11)
    full = kernels.silu_and_mul(g, u)
    assert all(torch.equal(kernels.silu_and_mul(g[i], u[i]), full[i]) for i in subsets)
    big = torch.full((1, 8), 1e4, device=DEV)  # exp(-gate) underflow / overflow stay finite
    assert torch.isfinite(kernels.silu_and_mul(torch.cat([big, -big]), torch.ones(2, 8, device=DEV))).all()


def test_row_strided_inputs():
    gu = randn(6, 2, 300, seed=22)  # a fused gate/up projection output, split into two strided views
    g, u = gu[:, 0], gu[:, 1]
    assert torch.equal(kernels.silu_and_mul(g, u), kernels.silu_and_mul(g.contiguous(), u.contiguous()))
    logits = randn(5, 700, seed=23)[:, :500]
    t = torch.tensor([0, 1, 2, 3, 499], device=DEV)
    assert torch.equal(kernels.token_logprobs(logits, t, 1.0), kernels.token_logprobs(logits.contiguous(), t, 1.0))
    assert torch.equal(kernels.log_softmax(logits), kernels.log_softmax(logits.contiguous()))
    x = randn(4, 2, 64, seed=24)[:, 1]
    w = randn(64, seed=25)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm(x.contiguous(), w, 1e-6))


def test_silu_and_mul_validation():
    with pytest.raises(ValueError, match="must match gate"):
        kernels.silu_and_mul(randn(3, 8), randn(3, 9))


# ---------------------------------------------------------------------------------------------- logprobs
def test_logprobs_match_float64():
    M, V, T = 12, 5000, 0.7
    logits = randn(M, V, seed=30, scale=4.0)
    logits[1, :4200] = float("-inf")  # a whole first block masked
    logits[2, ::3] = float("-inf")
    targets = torch.randint(0, V, (M,), generator=gen(31)).to(DEV)
    targets[1] = 4500
    ref = torch.log_softmax(logits.double().cpu() / T, dim=-1)
    ls = kernels.log_softmax(logits, T)
    assert ls.dtype == torch.float32 and rel_err(ls, ref) < RTOL
    lp = kernels.token_logprobs(logits, targets, T)
    ref_lp = ref.gather(1, targets[:, None].cpu())[:, 0]
    assert lp.dtype == torch.float32
    assert ((lp.double().cpu() - ref_lp).abs() / ref_lp.abs().clamp_min(1.0)).max().item() < RTOL
    # the two entry points share the per-row arithmetic exactly
    assert torch.equal(lp, ls.gather(1, targets[:, None])[:, 0])


def test_logprobs_batch_invariant_and_control():
    from nemo_rz.kernels.logprobs import token_logprobs as tlp

    M, V = 24, 5000
    logits = randn(M, V, seed=32, scale=3.0)
    targets = torch.randint(0, V, (M,), generator=gen(33)).to(DEV)
    # likely targets (logprob near 0, as most sampled tokens are) make the sum's last bits visible
    logits[torch.arange(M, device=DEV), targets] += torch.linspace(0, 20, M, device=DEV)
    full = kernels.token_logprobs(logits, targets, 1.0)
    subsets = batch_subsets(M)
    assert all(torch.equal(kernels.token_logprobs(logits[i], targets[i], 1.0), full[i]) for i in subsets)
    assert rows_identical(lambda a: kernels.log_softmax(a, 1.3), logits, subsets[:3])
    # control: a block size chosen by M (small batches: 512) changes the sum order and the bits
    by_m = lambda i: tlp(logits[i], targets[i], 1.0, _block_v=512 if len(i) < 8 else None)  # noqa: E731
    assert not all(torch.equal(by_m(i), full[i]) for i in subsets)


def test_logprobs_bad_target_is_nan_and_validation():
    logits = randn(2, 50, seed=34)
    lp = kernels.token_logprobs(logits, torch.tensor([3, 50], device=DEV), 1.0)
    assert torch.isfinite(lp[0]) and torch.isnan(lp[1])
    with pytest.raises(ValueError, match="temperature"):
        kernels.token_logprobs(logits, torch.tensor([0, 1], device=DEV), 0.0)
    with pytest.raises(ValueError, match="targets dtype"):
        kernels.token_logprobs(logits, torch.tensor([0.0, 1.0], device=DEV), 1.0)
    with pytest.raises(ValueError, match="targets is"):
        kernels.token_logprobs(logits, torch.tensor([0], device=DEV), 1.0)


# ---------------------------------------------------------------------------------------------- attention
H, HKV, D, L = 4, 2, 16, 96
LENS = (45, 20, 70)  # 135 query tokens; up to 3 KV blocks of 32
SCALE = D ** -0.5


def make_cache(seed=40):
    k = torch.full((len(LENS), HKV, L, D), float("nan"))
    v = torch.full_like(k, float("nan"))  # unwritten slots are NaN: any read of them would show
    for s, n in enumerate(LENS):
        k[s, :, :n] = torch.randn(HKV, n, D, generator=gen(seed + s))
        v[s, :, :n] = torch.randn(HKV, n, D, generator=gen(seed + 10 + s))
    return k.to(DEV), v.to(DEV)


def all_queries(seed=50):
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(LENS)])
    pos = torch.cat([torch.arange(n) for n in LENS])
    q = torch.randn(len(seq), H, D, generator=gen(seed))
    return q.to(DEV), seq.to(DEV), pos.to(DEV)


def attention_ref(q, k, v, seq, pos, window):
    out = torch.empty(q.shape, dtype=torch.float64)
    q, k, v, seq, pos = (t.cpu() for t in (q, k, v, seq, pos))
    for i in range(q.shape[0]):
        s, p = int(seq[i]), int(pos[i])
        lo = window_start(p, window)
        kk = k[s, :, lo : p + 1].double().repeat_interleave(H // HKV, 0)  # [H, n, D]
        vv = v[s, :, lo : p + 1].double().repeat_interleave(H // HKV, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[i].double(), kk) * SCALE, -1)
        out[i] = torch.einsum("hn,hnd->hd", w, vv)
    return out


def paged(k, v, page, seed=60):
    """Copy a contiguous cache into shuffled pages of `page` slots; return caches and block table."""
    per_seq = -(-L // page)
    nblocks = len(LENS) * per_seq + 3
    order = torch.randperm(nblocks, generator=gen(seed))[: len(LENS) * per_seq].view(len(LENS), per_seq)
    kp = torch.full((nblocks, HKV, page, D), float("nan"), device=DEV)
    vp = kp.clone()
    for s in range(len(LENS)):
        for j in range(per_seq):
            n = min(page, L - j * page)
            kp[order[s, j], :, :n] = k[s, :, j * page : j * page + n]
            vp[order[s, j], :, :n] = v[s, :, j * page : j * page + n]
    return kp, vp, order.to(torch.int32).to(DEV)


@pytest.fixture(scope="module")
def prefill():
    k, v = make_cache()
    q, seq, pos = all_queries()
    return k, v, q, seq, pos, kernels.attention(q, k, v, seq, pos, SCALE)


def test_attention_matches_float64(prefill):
    k, v, q, seq, pos, out = prefill
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert rel_err(out, attention_ref(q, k, v, seq, pos, None)) < RTOL


def test_attention_decode_equals_prefill(prefill):
    k, v, q, seq, pos, out = prefill
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(LENS), 0)[:-1].tolist()])
    picks = [int(starts[s]) + p for s, n in enumerate(LENS) for p in (0, 31, 32, 33, n - 1)]
    for i in picks:  # one query alone, its cache holding only positions <= p
        kd, vd = k.clone(), v.clone()
        kd[int(seq[i]), :, int(pos[i]) + 1 :] = float("nan")
        vd[int(seq[i]), :, int(pos[i]) + 1 :] = float("nan")
        one = kernels.attention(q[i : i + 1], kd, vd, seq[i : i + 1], pos[i : i + 1], SCALE)
        assert torch.equal(one[0], out[i]), i
    idx = torch.tensor(picks[::-1][:7])  # a batched decode step in another order
    assert torch.equal(kernels.attention(q[idx], k, v, seq[idx], pos[idx], SCALE), out[idx])


def test_attention_chunked_prefill_and_any_batch_order(prefill):
    k, v, q, seq, pos, out = prefill
    chunks = [torch.arange(a, min(a + 17, len(seq))) for a in range(0, len(seq), 17)]  # cuts across sequences
    got = torch.cat([kernels.attention(q[c], k, v, seq[c], pos[c], SCALE) for c in chunks])
    assert torch.equal(got, out)
    some = torch.randperm(len(seq), generator=gen(70))[:40]  # another batch composition and order
    assert torch.equal(kernels.attention(q[some], k, v, seq[some], pos[some], SCALE), out[some])


def test_attention_paged_equals_contiguous(prefill):
    k, v, q, seq, pos, out = prefill
    kp, vp, table = paged(k, v, 24)  # 24 slots per page: some KV blocks span two pages
    assert torch.equal(kernels.attention(q, kp, vp, seq, pos, SCALE, block_table=table), out)


def test_attention_sliding_window(prefill):
    k, v, q, seq, pos, _ = prefill
    win = 20
    out = kernels.attention(q, k, v, seq, pos, SCALE, window=win)
    assert rel_err(out, attention_ref(q, k, v, seq, pos, win)) < RTOL
    i = LENS[0] - 1  # decode of the last token of sequence 0, with the keys before its window poisoned
    kd = k.clone()
    kd[0, :, : window_start(i, win)] = float("nan")
    assert torch.equal(kernels.attention(q[i : i + 1], kd, v, seq[i : i + 1], pos[i : i + 1], SCALE, win)[0], out[i])
    kp, vp, table = paged(k, v, 16)
    assert torch.equal(kernels.attention(q, kp, vp, seq, pos, SCALE, window=win, block_table=table), out)


def test_attention_mha_and_strided_q():
    k, v = make_cache(seed=80)
    q, seq, pos = all_queries(seed=81)
    some = torch.randperm(len(seq), generator=gen(82))[:24]
    q, seq, pos = q[some], seq[some], pos[some]
    kk, vv = k[:, :1].repeat(1, H, 1, 1).contiguous(), v[:, :1].repeat(1, H, 1, 1).contiguous()  # Hkv == H
    qkv = torch.cat([q, q], dim=2)  # q as a strided view, as from a fused qkv projection
    out = kernels.attention(qkv[:, :, :D], kk, vv, seq, pos, SCALE)
    assert torch.equal(out, kernels.attention(q, kk, vv, seq, pos, SCALE))
    ref = attention_ref(q, k[:, :1].repeat(1, HKV, 1, 1), v[:, :1].repeat(1, HKV, 1, 1), seq, pos, None)
    assert rel_err(out, ref) < RTOL


def test_attention_head_dim_not_power_of_two():
    d = 20
    k = randn(2, HKV, 40, d, seed=90)
    v = randn(2, HKV, 40, d, seed=91)
    q = randn(12, H, d, seed=92)
    seq = torch.tensor([0] * 6 + [1] * 6, device=DEV)
    pos = torch.tensor([0, 5, 31, 32, 33, 39] * 2, device=DEV)
    out = kernels.attention(q, k, v, seq, pos, d ** -0.5, window=9)
    ref = torch.empty(out.shape, dtype=torch.float64)
    for i in range(12):
        s, p = int(seq[i]), int(pos[i])
        lo = window_start(p, 9)
        kk = k[s, :, lo : p + 1].double().cpu().repeat_interleave(H // HKV, 0)
        vv = v[s, :, lo : p + 1].double().cpu().repeat_interleave(H // HKV, 0)
        w = torch.softmax(torch.einsum("hd,hnd->hn", q[i].double().cpu(), kk) * d ** -0.5, -1)
        ref[i] = torch.einsum("hn,hnd->hd", w, vv)
    assert rel_err(out, ref) < RTOL


def test_attention_control_kv_block_differs(prefill):
    # The decode==prefill check can fail: a decode kernel with another KV split size gives other bits.
    from nemo_rz.kernels.causal_attention import KV_BLOCK, _attention

    k, v, q, seq, pos, out = prefill
    idx = torch.tensor([30, 44, 100, 134])  # positions >= 16: more than one block of 16
    dec = _attention(q[idx], k, v, seq[idx], pos[idx], SCALE, None, None, KV_BLOCK // 2)
    assert rel_err(dec, out[idx]) < RTOL
    assert not torch.equal(dec, out[idx])


def test_attention_validation():
    k, v = make_cache()
    q, seq, pos = all_queries()
    with pytest.raises(ValueError, match="multiple of KV heads"):
        kernels.attention(q[:, :3].contiguous(), k, v, seq, pos, SCALE)
    with pytest.raises(ValueError, match="head dim"):
        kernels.attention(q[..., :8].contiguous(), k, v, seq, pos, SCALE)
    with pytest.raises(ValueError, match="seq_idx dtype"):
        kernels.attention(q, k, v, seq.float(), pos, SCALE)
    with pytest.raises(ValueError, match="must have Nq"):
        kernels.attention(q, k, v, seq[:3], pos, SCALE)
    with pytest.raises(ValueError, match="window"):
        kernels.attention(q, k, v, seq, pos, SCALE, window=0)
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        kernels.attention(q, k.transpose(1, 2), v.transpose(1, 2), seq, pos, SCALE)


# ---------------------------------------------------------------------------------------------- attention sinks
SINKS = torch.tensor([-1.0, 0.5, 3.0, 30.0])  # one per query head; the last one outweighs every key


def sink_ref(q, k, v, seq, pos, window, sinks):
    """Softmax over [scores, sink], the sink's column dropped, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    q, k, v, seq, pos = (t.cpu() for t in (q, k, v, seq, pos))
    for i in range(q.shape[0]):
        s, p = int(seq[i]), int(pos[i])
        lo = window_start(p, window)
        kk = k[s, :, lo : p + 1].double().repeat_interleave(H // HKV, 0)
        vv = v[s, :, lo : p + 1].double().repeat_interleave(H // HKV, 0)
        scores = torch.einsum("hd,hnd->hn", q[i].double(), kk) * SCALE
        w = torch.softmax(torch.cat([scores, sinks.double()[:, None]], 1), -1)[:, :-1]
        out[i] = torch.einsum("hn,hnd->hd", w, vv)
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_attention_sinks_match_float64_and_decode_equals_prefill(prefill, window):
    k, v, q, seq, pos, _ = prefill
    some = torch.arange(0, len(seq), 4)  # a third of the queries keeps the interpreter quick
    q, seq, pos = q[some], seq[some], pos[some]
    sinks = SINKS.to(DEV)
    out = kernels.attention(q, k, v, seq, pos, SCALE, window, sinks=sinks)
    assert rel_err(out, sink_ref(q, k, v, seq, pos, window, SINKS)) < RTOL
    assert rel_err(out, attention_ref(q, k, v, seq, pos, window)) > 1e-2  # the sinks do take weight
    idx = torch.tensor([0, 8, 11, 16, 33, 25])  # a decode step in another order, then one query alone
    assert torch.equal(kernels.attention(q[idx], k, v, seq[idx], pos[idx], SCALE, window, sinks=sinks), out[idx])
    assert torch.equal(kernels.attention(q[11:12], k, v, seq[11:12], pos[11:12], SCALE, window, sinks=sinks)[0], out[11])
    kp, vp, table = paged(k, v, 24)
    assert torch.equal(kernels.attention(q, kp, vp, seq, pos, SCALE, window, table, sinks=sinks.bfloat16()),
                       kernels.attention(q, k, v, seq, pos, SCALE, window, sinks=sinks.bfloat16().float()))
    with pytest.raises(ValueError, match="one logit per query head"):
        kernels.attention(q, k, v, seq, pos, SCALE, sinks=sinks[:2])


def test_attention_per_layer_windows_in_one_forward(prefill):
    """Alternating sliding-window and full layers over the same tokens: each call equals its own reference."""
    k, v, q, seq, pos, full = prefill
    some = torch.arange(1, len(seq), 4)
    q, seq, pos, full = q[some], seq[some], pos[some], full[some]
    for window in (20, None, 8, None):
        out = kernels.attention(q, k, v, seq, pos, SCALE, window)
        assert rel_err(out, attention_ref(q, k, v, seq, pos, window)) < RTOL
        if window is None:
            assert torch.equal(out, full)


# ---------------------------------------------------------------------------------------------- expert_linear
N_EXPERTS = 4


def expert_inputs(M=70, K=48, N=40, seed=110, dtype=torch.float32):
    g = gen(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N_EXPERTS, K, N, generator=g) / K ** 0.5
    b = torch.randn(N_EXPERTS, N, generator=g)
    experts = torch.randint(0, N_EXPERTS, (M,), generator=g)
    return x.to(dtype).to(DEV), experts.to(DEV), w.to(dtype).to(DEV), b.to(DEV)


def expert_ref(x, experts, w, b):
    x, experts, w, b = (t.cpu() for t in (x, experts, w, b))
    return torch.einsum("mk,mkn->mn", x.double(), w.double()[experts]) + b.double()[experts]


# The interpreter (Triton 3.9) gets bfloat16 tl.dot wrong (kernels.linear too): bfloat16 runs on a GPU only.
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="the Triton interpreter computes bfloat16 products wrongly"))])
def test_expert_linear_matches_float64(dtype):
    x, experts, w, b = expert_inputs(dtype=dtype)
    out = kernels.expert_linear(x, experts, w, b)
    assert out.dtype == dtype
    assert rel_err(out, expert_ref(x, experts, w, b)) < (RTOL if dtype == torch.float32 else 1e-2)
    assert rel_err(kernels.expert_linear(x, experts, w), expert_ref(x, experts, w, torch.zeros_like(b))) < (
        RTOL if dtype == torch.float32 else 1e-2)


def _alone_vs_batch(fn, x, experts):
    """Rows whose bits differ between the batch and a call of one row (every expert load here: 1 row)."""
    batch = fn(x, experts)
    alone = torch.cat([fn(x[m : m + 1], experts[m : m + 1]) for m in range(0, x.shape[0], 5)])
    return int((alone != batch[::5]).any(-1).sum())


def test_expert_linear_row_ignores_batch_and_load_and_control():
    from nemo_rz.kernels.moe import TileConfig, _expert_linear, expert_config

    x, experts, w, b = expert_inputs()
    skip_unless_dot_row_invariant(expert_config(x.dtype, w.shape[2], w.shape[1]))
    fn = lambda xs, es: kernels.expert_linear(xs, es, w, b)  # noqa: E731
    assert rows_identical(lambda i: fn(x[i], experts[i]), torch.arange(x.shape[0]), batch_subsets(x.shape[0]))
    crowded = torch.where(torch.arange(x.shape[0], device=DEV) % 9 == 0, experts, 2)  # expert 2 gets 62 rows
    assert _alone_vs_batch(fn, x, experts) == 0 and _alone_vs_batch(fn, x, crowded) == 0
    assert torch.equal(fn(x, crowded)[crowded != 2], fn(x, experts)[crowded != 2])

    # Control: a K split chosen from the expert's load (as a library heuristic would) changes a row's bits.
    def by_load(xs, es):
        cfg = expert_config(xs.dtype, w.shape[2], w.shape[1])
        block_k = 16 if xs.shape[0] < 8 else cfg.block_k
        return _expert_linear(xs, es, w, b, TileConfig(cfg.block_m, cfg.block_n, block_k, num_warps=cfg.num_warps))

    assert _alone_vs_batch(by_load, x, experts) > 0


def test_expert_linear_tile_table_covers_every_row_once():
    from nemo_rz.kernels.moe import tile_table

    experts = torch.tensor([3, 0, 3, 3, 1, 0, 3, 3, 3], device=DEV)
    order, tile_expert, tile_start, group_end = tile_table(experts, N_EXPERTS, 2)
    assert order.tolist() == [1, 5, 4, 0, 2, 3, 6, 7, 8]  # stable: by expert, then by row
    assert group_end.tolist() == [2, 3, 3, 9]
    real = tile_expert < N_EXPERTS
    assert tile_expert[real].tolist() == [0, 1, 3, 3, 3] and tile_start[real].tolist() == [0, 2, 3, 5, 7]
    assert tile_expert.shape[0] == -(-9 // 2) + N_EXPERTS


def test_expert_linear_validation():
    x, experts, w, b = expert_inputs()
    with pytest.raises(ValueError, match="weight_t dtype"):
        kernels.expert_linear(x, experts, w.double(), b)
    with pytest.raises(ValueError, match="disagree"):
        kernels.expert_linear(x, experts[:5], w, b)
    with pytest.raises(ValueError, match="bias must be"):
        kernels.expert_linear(x, experts, w, b[:, :3].contiguous())
    with pytest.raises(ValueError, match="experts dtype"):
        kernels.expert_linear(x, experts.float(), w, b)


def test_ops_dispatch_moe_and_sinks_to_kernels(monkeypatch, prefill):
    """Consistent ops on 'CUDA' (forced here) call these kernels and agree with the torch path."""
    import importlib

    from nemo_rz import ops

    k, v, q, seq, pos, _ = prefill
    k, v = k.nan_to_num(), v.nan_to_num()  # the torch path reads whole key blocks: no NaN past the positions
    x, experts, w, b = expert_inputs()
    torch_moe = ops.expert_linear(x, experts, w, b)
    torch_attn = ops.attention(q, k, v, seq, pos, SCALE, 20, sinks=SINKS.to(DEV))
    calls = []
    for name in ("expert_linear", "attention"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _n=name, **kw: (calls.append(_n), _fn(*a, **kw))[1])
    for mod in ("moe", "attention"):
        monkeypatch.setattr(importlib.import_module(f"nemo_rz.ops.{mod}"), "on_gpu_kernels", lambda t: True)
    xg = x.clone().requires_grad_()
    on_kernels = ops.expert_linear(xg, experts, w, b)
    assert rel_err(on_kernels, torch_moe.double()) < RTOL
    on_kernels.sum().backward()  # the library backward behind the kernel's forward
    assert torch.allclose(xg.grad, torch.einsum("mkn->mk", w[experts]), atol=1e-5)
    assert rel_err(ops.attention(q, k, v, seq, pos, SCALE, 20, sinks=SINKS.to(DEV)), torch_attn.double()) < RTOL
    assert calls == ["expert_linear", "attention"]


# ---------------------------------------------------------------------------------------------- GPU build, script
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_kernels.py"


def _script(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run([sys.executable, str(BENCH), *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_kernels_compile_to_cuda_binaries():
    """Every kernel builds to an sm_90 cubin with Triton's own ptxas: GPU compile errors show up on CPU CI."""
    if not BENCH.exists():
        pytest.skip("benchmarks/gpu_kernels.py not present")
    res = _script("--compile-only", "--arch", "90")
    if res.returncode and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("Triton's ptxas is not available")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "compiled 24 kernels" in res.stdout


def test_benchmark_script_smoke():
    if not BENCH.exists() or not INTERPRET:
        pytest.skip("needs benchmarks/gpu_kernels.py and the interpreter")
    res = _script("--interpret", "--small", "--kernels", "rms_norm,token_logprobs,log_softmax")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "0 failed checks" in res.stdout
