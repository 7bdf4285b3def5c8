"""Library kernels on probed routes (ops/verified.py, ops/gemm.py): the probes can fail, the routes keep every
row's bits whatever the row count or thread count, gradients repeat bit for bit, and the blocked log-softmax is
accurate at real vocabulary sizes."""
import pytest
import torch
from conftest import mkl_avx512_path, tiny_model

from nemo_rz import ops
from nemo_rz.ops import verified
from nemo_rz.ops.logprobs import log_softmax_tiled

SMOLLM2_LINEARS = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # (K, N) of SmolLM2-135M's linears


def _rows_equal_everywhere(fn, x: torch.Tensor, counts) -> list[int]:
    """Row counts M for which fn(x[:M]) differs from the first M rows of fn(x)."""
    full = fn(x)
    return [m for m in counts if not torch.equal(fn(x[:m].clone()), full[:m])]


def test_probe_rejects_a_kernel_whose_rows_depend_on_the_row_count():
    """Negative control: a product that splits K in two for larger calls (as a BLAS might) has no route."""
    w = torch.randn(64, 32)

    def split_k(x):
        if x.shape[0] <= 8:
            return x @ w
        return x[:, :32] @ w[:32] + x[:, 32:] @ w[32:]

    assert verified._route(split_k, 64, torch.float32, "cpu") is None
    assert verified._route(lambda x: x * 2.0, 64, torch.float32, "cpu") is not None  # (a GEMM's own route is per CPU)


def test_probe_pads_only_what_differs():
    """A kernel whose single-row calls take another path (as a matrix-vector product would) gets min_rows 2. (An
    exact row-wise map underneath: a real GEMM's own row-count paths differ per CPU; AVX2 MKL's go up to 11 rows.)"""
    w = torch.randn(64, 64).sign()

    def odd_single_row(x):
        return x * w[0] + (1e-3 if x.shape[0] == 1 else 0.0)

    route = verified._route(odd_single_row, 64, torch.float32, "cpu")
    assert route is not None and route.min_rows == 2
    x = torch.randn(300, 64)
    assert _rows_equal_everywhere(lambda r: verified.by_rows(odd_single_row, r, route), x, range(1, 301)) == []
    assert _rows_equal_everywhere(odd_single_row, x, [1]) == [1]


def test_by_rows_pads_and_chunks():
    route = verified.Route(chunk=64, min_rows=4)
    x = torch.randn(203, 16)
    seen = []

    def record(rows):
        seen.append(rows.shape[0])
        return rows * 2.0

    for m in (1, 3, 4, 64, 65, 129, 131, 203):
        seen.clear()
        assert torch.equal(verified.by_rows(record, x[:m], route), x[:m] * 2.0)
        assert all(4 <= s <= 64 for s in seen), (m, seen)


@pytest.mark.skipif(not mkl_avx512_path(),
                    reason="the routes measured for MKL on AVX-512 CPUs (Intel's: MKL takes its AVX2 path on AMD CPUs)")
def test_platform_gemm_keeps_its_routes():
    """Fails if the BLAS changes behaviour here: with a contiguous [K, N] weight, MKL's GEMM is row-invariant
    from 2 rows up to a chunk at the shapes of a real model (a single row takes the matrix-vector path)."""
    for k, n in SMOLLM2_LINEARS + [(576, 49152)]:
        route = verified.matmul_route(k, n, torch.float32, "cpu")
        assert route is not None and route.min_rows == 2 and route.chunk == 256, (k, n, route)
    assert verified.bmm_verified(64, ops.KV_BLOCK, torch.float32, "cpu")


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 576), (64, 48)])
def test_linear_rows_are_invariant_for_every_row_count(k, n):
    """Every row count 1..300 (more than a chunk), not just the probed ones; fast mode is the negative control."""
    torch.manual_seed(k)
    weight = torch.nn.Parameter(torch.randn(n, k) / k ** 0.5)
    x = torch.randn(300, k)
    with torch.no_grad():
        assert _rows_equal_everywhere(lambda r: ops.linear(r, weight), x, range(1, 301)) == []
        with ops.use_kernels("fast"):
            assert _rows_equal_everywhere(lambda r: ops.linear(r, weight), x, range(1, 301)) != []


def test_thread_count_does_not_change_the_bits():
    """A 2-thread learner and a 1-thread rollout worker must agree: routed calls run on one thread."""
    model = tiny_model(vocab_size=64, hidden_size=64, intermediate_size=192)
    ids = torch.randint(0, 64, (5, 40), generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            one = model.token_logprobs(ids)
        torch.set_num_threads(2)
        with torch.no_grad():
            two = model.token_logprobs(ids)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_learner_gradients_repeat_bit_for_bit():
    """Resume is bit-exact only if a learner step is: same batch, same gradients."""
    model = tiny_model(vocab_size=64)
    ids = torch.randint(0, 64, (6, 33), generator=torch.Generator().manual_seed(1))

    def grads():
        model.zero_grad(set_to_none=True)
        model.token_logprobs(ids).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    # The library backward computes the same gradient as autograd through the plain library forward.
    model.zero_grad(set_to_none=True)
    with ops.use_kernels("fast"):
        model.token_logprobs(ids).sum().backward()
    for a, p in zip(first, model.parameters()):
        assert (a - p.grad).abs().max() <= 1e-5 * p.grad.abs().max()


def test_weight_copies_follow_updates():
    """The [K, N] copy of a weight is refreshed by in-place updates; writes through .data need forget."""
    layer = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 64)
    with torch.no_grad():
        ops.linear(x, layer.weight)
        layer.weight.mul_(2.0)  # an in-place update (as an optimizer step): seen
        assert torch.allclose(ops.linear(x, layer.weight), x @ layer.weight.t(), atol=1e-6)
        layer.weight.data.copy_(torch.zeros(32, 64))  # bypasses the version counter: the copy is stale
        assert ops.linear(x, layer.weight).abs().sum() > 0
        ops.forget_weight_copies(layer)
        assert ops.linear(x, layer.weight).abs().sum() == 0


@pytest.mark.parametrize("vocab", [32000, 151936])
def test_log_softmax_accuracy_at_real_vocabulary_sizes(vocab):
    """Within 1e-5 of float64 (absolute, and relative to |log p|) on both consistent paths and under
    batch_invariant(); torch's single running float32 sum is the reference's foil (it is off by more)."""
    torch.manual_seed(vocab)
    x = torch.randn(8, vocab) * 4.0
    ref = torch.log_softmax(x.double(), -1)

    def errors(out):
        err = (out.double() - ref).abs()
        return float(err.max()), float((err / ref.abs()).max())

    with ops.batch_invariant():
        override = torch.log_softmax(x, -1)
    for out in (ops.log_softmax(x), log_softmax_tiled(x), override):
        absolute, relative = errors(out)
        assert absolute <= 1e-5 and relative <= 1e-5, (absolute, relative)
    if vocab == 151936:
        assert errors(torch.log_softmax(x, -1))[0] > 1e-5


def test_blocked_log_softmax_gradient_is_the_library_one():
    x = (torch.randn(7, 1000) * 3).requires_grad_()
    g = torch.randn(7, 1000)
    ops.log_softmax(x).backward(g)
    ours = x.grad.clone()
    x.grad = None
    torch.log_softmax(x, -1).backward(g)
    assert torch.allclose(ours, x.grad, atol=1e-6)


def test_batch_invariant_addmm_ignores_the_bias_when_beta_is_zero():
    bias = torch.full((3,), float("nan"))
    a, b = torch.randn(5, 4), torch.randn(4, 3)
    with ops.batch_invariant():
        out = torch.addmm(bias, a, b, beta=0)
    assert torch.isfinite(out).all() and torch.allclose(out, a @ b, atol=1e-6)


def test_tiles_fallback_stays_bit_identical(monkeypatch):
    """With the library routes off (NEMO_RZ_VERIFIED=0), the fixed tiles keep rollout and learner equal."""
    from conftest import count_diff

    from nemo_rz.generation import RolloutEngine, SamplingParams

    monkeypatch.setattr(verified, "_ENABLED", False)
    model = tiny_model(seed=3)
    engine = RolloutEngine(model, max_batch_size=8, max_model_len=64)
    prompts = [[1 + i % 40] * (3 + 5 * i) for i in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=0))
    assert count_diff(model, outs) == (0, 72)
