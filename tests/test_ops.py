"""Each consistent op: close to a float64 reference, and bitwise row-invariant; fast ops are the control."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rz import ops


def _rows_invariant(fn, x: torch.Tensor, sizes) -> bool:
    """Row 0 of fn(x[:m]) is the same bits for every m, and a row keeps its bits wherever it sits."""
    ref = fn(x[:1])[0]
    for m in sizes:
        if not torch.equal(fn(x[:m])[0], ref):
            return False
        perm = torch.randperm(m, generator=torch.Generator().manual_seed(m))
        where = int((perm == 0).nonzero())
        if not torch.equal(fn(x[:m][perm])[where], ref):
            return False
    return True


torch.manual_seed(0)
W = torch.randn(96, 80)
B = torch.randn(96)
NORM_W = torch.randn(80)
X = torch.randn(130, 80)

OPS = {
    "linear": (lambda x: ops.linear(x, W, B), lambda x: x.double() @ W.double().t() + B.double()),
    "rms_norm": (
        lambda x: ops.rms_norm(x, NORM_W, 1e-6),
        lambda x: x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * NORM_W.double(),
    ),
    "silu_and_mul": (lambda x: ops.silu_and_mul(x, x.flip(-1)), lambda x: torch.nn.functional.silu(x.double()) * x.double().flip(-1)),
    "log_softmax": (lambda x: ops.log_softmax(x * 4, 0.7), lambda x: torch.log_softmax(x.double() * 4 / 0.7, -1)),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_matches_float64_reference(name):
    fn, ref = OPS[name]
    out, expect = fn(X).double(), ref(X)
    assert ((out - expect).abs().max() / expect.abs().max()) < 1e-6


@pytest.mark.parametrize("name", sorted(OPS))
def test_op_is_row_invariant(name):
    assert _rows_invariant(OPS[name][0], X, [2, 3, 7, 31, 32, 33, 64, 100, 130])


def test_fast_linear_is_not_row_invariant():
    with ops.use_kernels("fast"):
        assert not _rows_invariant(OPS["linear"][0], X, [2, 3, 7, 31, 32, 33, 64, 100, 130])


def test_token_logprobs_is_gathered_log_softmax():
    targets = torch.randint(0, 80, (130,))
    assert torch.equal(ops.token_logprobs(X, targets, 1.3), ops.log_softmax(X, 1.3).gather(1, targets[:, None])[:, 0])
    per_row = torch.full((130,), 1.3)
    assert torch.equal(ops.log_softmax(X, per_row), ops.log_softmax(X, 1.3))


def _attention_setup(seed, n_seq=3, length=70, heads=4, kv_heads=2, dim=16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_seq, kv_heads, 96, dim, generator=g)
    v = torch.randn(n_seq, kv_heads, 96, dim, generator=g)
    q = torch.randn(n_seq, length, heads, dim, generator=g)
    return q, k, v


def _reference_attention(q, k, v, seq, pos, window=None):
    heads, kv_heads = q.shape[1], k.shape[1]
    out = []
    for i in range(q.shape[0]):
        keys = k[seq[i]].repeat_interleave(heads // kv_heads, 0).double()[:, : pos[i] + 1]
        vals = v[seq[i]].repeat_interleave(heads // kv_heads, 0).double()[:, : pos[i] + 1]
        s = torch.einsum("hd,hld->hl", q[i].double(), keys) * q.shape[-1] ** -0.5
        if window is not None:
            s[:, : max(0, pos[i] + 1 - window)] = float("-inf")
        out.append(torch.einsum("hl,hld->hd", torch.softmax(s, -1), vals))
    return torch.stack(out)


@pytest.mark.parametrize("window", [None, 9])
def test_attention_matches_reference_and_decode_equals_prefill(window):
    q, k, v = _attention_setup(0)
    scale = q.shape[-1] ** -0.5
    seq = torch.arange(3).repeat_interleave(70)
    pos = torch.arange(70).repeat(3)
    flat = q.reshape(-1, 4, 16)
    prefill = ops.attention(flat, k, v, seq, pos, scale, window)
    ref = _reference_attention(flat, k, v, seq, pos, window)
    assert (prefill.double() - ref).abs().max() < 1e-5
    for i in [0, 31, 32, 33, 69, 70 + 5, 209]:  # one query alone, as in decode
        alone = ops.attention(flat[i : i + 1], k, v, seq[i : i + 1], pos[i : i + 1], scale, window)
        assert torch.equal(alone[0], prefill[i])


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 60))
def test_attention_row_is_independent_of_the_batch(seed, n):
    q, k, v = _attention_setup(1)
    scale = q.shape[-1] ** -0.5
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 3, (n,), generator=g)
    pos = torch.randint(0, 70, (n,), generator=g)
    tok = torch.randint(0, 70, (n,), generator=g)
    qs = q[seq, tok]
    batch = ops.attention(qs, k, v, seq, pos, scale)
    for i in range(0, n, max(1, n // 4)):
        assert torch.equal(ops.attention(qs[i : i + 1], k, v, seq[i : i + 1], pos[i : i + 1], scale)[0], batch[i])


def test_fast_attention_decode_differs_from_prefill():
    q, k, v = _attention_setup(2)
    scale = q.shape[-1] ** -0.5
    seq = torch.zeros(70, dtype=torch.long)
    pos = torch.arange(70)
    with ops.use_kernels("fast"):
        prefill = ops.attention(q[0], k, v, seq, pos, scale)
        decode = torch.cat([ops.attention(q[0, i : i + 1], k, v, seq[:1], pos[i : i + 1], scale) for i in range(70)])
    assert not torch.equal(prefill, decode)


def test_paged_cache_equals_contiguous():
    q, k, v = _attention_setup(3)
    scale = q.shape[-1] ** -0.5
    block = 16  # a paged layout: [num_blocks, Hkv, block, D], blocks shuffled
    n_blocks = k.shape[0] * k.shape[2] // block
    perm = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0))
    k_paged = k.reshape(3, 2, -1, block, 16).permute(0, 2, 1, 3, 4).reshape(n_blocks, 2, block, 16)
    v_paged = v.reshape(3, 2, -1, block, 16).permute(0, 2, 1, 3, 4).reshape(n_blocks, 2, block, 16)
    table = torch.empty(n_blocks, dtype=torch.long)
    table[perm] = torch.arange(n_blocks)
    k_shuf, v_shuf = k_paged[perm], v_paged[perm]
    block_table = table.view(3, -1)
    seq = torch.arange(3).repeat_interleave(70)
    pos = torch.arange(70).repeat(3)
    flat = q.reshape(-1, 4, 16)
    assert torch.equal(
        ops.attention(flat, k_shuf, v_shuf, seq, pos, scale, block_table=block_table),
        ops.attention(flat, k, v, seq, pos, scale),
    )


def test_kernel_set_switch_and_errors():
    assert ops.get_kernels() == "consistent"
    with ops.use_kernels("fast"):
        assert ops.get_kernels() == "fast"
    assert ops.get_kernels() == "consistent"
    with pytest.raises(ValueError, match="unknown kernel set 'exact'"):
        ops.set_kernels("exact")
    env = dict(os.environ, NEMO_RZ_KERNELS="fast")
    out = subprocess.run([sys.executable, "-c", "import nemo_rz.ops as o; print(o.get_kernels())"], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "fast"


def test_batch_invariant_context_makes_a_transformers_model_batch_invariant():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 64, (40, 3))  # short rows: small M, where MKL changes kernels with M

    def row0_same(b_sizes):
        with torch.no_grad():
            ref = model(ids[:1]).logits[0]
            return all(torch.equal(model(ids[:b]).logits[0], ref) for b in b_sizes)

    with ops.batch_invariant():
        assert row0_same([2, 5, 17, 40])
        x = torch.randn(9, 33)
        assert torch.equal(x[:1].mean(-1), x.mean(-1)[:1])
    assert not row0_same([2, 5, 17, 40]), "negative control: without the overrides the rows differ"
