"""nemo_rz.ops in consistent mode dispatches to the Triton kernels on CUDA tensors, and both paths agree.

No GPU here: the dispatch predicate is forced on for CPU tensors and the kernels run under the Triton
interpreter, which exercises the real call path (argument order, shapes, dtypes) end to end.
"""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import contextlib  # noqa: E402
import importlib  # noqa: E402

import torch  # noqa: E402
from conftest import count_diff, skip_unless_dot_row_invariant, tiny_model  # noqa: E402

from nemo_rz import kernels, ops  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.kernels
# importlib: the package re-exports functions under the same names as these modules
OP_MODULES = [importlib.import_module(f"nemo_rz.ops.{m}")
              for m in ("linear", "norm", "activation", "logprobs", "attention", "moe")]
consistent = importlib.import_module("nemo_rz.ops.kernel_set").consistent


@pytest.fixture
def gpu_dispatch(monkeypatch):
    """Route consistent ops to nemo_rz.kernels as on CUDA, and count the kernel calls."""
    calls = []
    for name in ("linear", "rms_norm", "silu_and_mul", "log_softmax", "token_logprobs", "attention", "expert_linear"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _fn=fn, _n=name, **k: (calls.append(_n), _fn(*a, **k))[1])
    for mod in OP_MODULES:
        monkeypatch.setattr(mod, "on_gpu_kernels", lambda x: consistent())
    return calls


def test_decoder_on_kernels_agrees_with_torch_path_and_stays_mismatch_free(gpu_dispatch):
    model = tiny_model(seed=4, vocab_size=64, hidden_size=64, num_heads=4, num_kv_heads=2)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    on_kernels = model.token_logprobs(ids).detach()
    assert set(gpu_dispatch) >= {"linear", "rms_norm", "silu_and_mul", "attention", "token_logprobs"}
    for mod in OP_MODULES:  # back to the CPU torch path
        mod.on_gpu_kernels = lambda x: False
    on_torch = model.token_logprobs(ids).detach()
    assert (on_kernels - on_torch).abs().max() < 1e-4
    for mod in OP_MODULES:
        mod.on_gpu_kernels = lambda x: consistent()
    from nemo_rz.kernels.matmul import tile_config

    skip_unless_dot_row_invariant(tile_config(torch.float32, 64, 64))  # (the agreement above still ran)
    outs = RolloutEngine(model, max_batch_size=4).generate([[1, 2, 3], [4] * 9, [5, 6]], SamplingParams(6, seed=1))
    assert count_diff(model, outs)[0] == 0  # the kernels are batch-invariant on their own


# -- gradients: the kernels' forward with the library backward --------------------------------------------------
GRAD_TOL = dict(rtol=1e-4, atol=1e-5)  # float32; measured differences are ~1e-6 (the forwards differ by rounding)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)  # a bf16 gradient: the same float32 value may round to a neighbour


def assert_grads_close(g, ref, **tol):
    torch.testing.assert_close(g, ref, **(tol or (GRAD_TOL if g.dtype == torch.float32 else BF16_TOL)))


@contextlib.contextmanager
def torch_path():
    """The consistent torch path (as on CPU) for the duration of the block."""
    saved = [mod.on_gpu_kernels for mod in OP_MODULES]
    for mod in OP_MODULES:
        mod.on_gpu_kernels = lambda x: False
    try:
        yield
    finally:
        for mod, fn in zip(OP_MODULES, saved):
            mod.on_gpu_kernels = fn


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _attention_case(sinks: bool):
    # As the learner calls it: the caches are transposed, padded views of the batch's keys and values
    # ([B, T, Hkv, D] -> [B, Hkv, L, D]); 2 sequences of 10 tokens, GQA 4/2 heads, window 4.
    seq, pos = torch.arange(2).repeat_interleave(10), torch.arange(10).repeat(2)

    def fn(q, k, v, s=None):
        k_all = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, 22)).transpose(1, 2)
        v_all = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, 22)).transpose(1, 2)
        return ops.attention(q, k_all, v_all, seq, pos, 0.25, 4, sinks=s)

    inputs = [_randn(20, 4, 16, seed=1), _randn(2, 10, 2, 16, seed=2), _randn(2, 10, 2, 16, seed=3)]
    return (fn, *inputs, _randn(4, seed=4)) if sinks else (fn, *inputs)


OP_CASES = {  # name: (fn, *inputs); every floating input is differentiated
    "linear": (ops.linear, _randn(2, 5, 32), _randn(24, 32, seed=1), _randn(24, seed=2)),
    # float32 activations on a bf16 weight (an MoE router in a bf16 model): the product runs in float32
    "linear_bf16_weight": (ops.linear, _randn(6, 32), _randn(24, 32, seed=1).bfloat16(), _randn(24, seed=2)),
    "rms_norm": (lambda x, w: ops.rms_norm(x, w, 1e-6), _randn(2, 5, 32), _randn(32, seed=1)),
    # gate and up: the two halves of one fused projection (strided views), as the MLP passes them
    "silu_and_mul": (lambda gu: ops.silu_and_mul(gu[:, :32], gu[:, 32:]), _randn(10, 64)),
    "log_softmax": (lambda x: ops.log_softmax(x, 0.7), _randn(6, 200)),
    "token_logprobs": (lambda x: ops.token_logprobs(x, torch.arange(6) * 31, 0.7), _randn(6, 200)),
    "attention": _attention_case(sinks=False),
    "attention_sinks": _attention_case(sinks=True),
}


def value_and_grads(fn, *inputs):
    """fn's output and the gradients of <output, a fixed random cotangent> for every input (None: no gradient)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    if out.requires_grad:
        out.backward(_randn(*out.shape, seed=9))
    return out.detach(), [x.grad for x in leaves]


@pytest.mark.parametrize("op", list(OP_CASES))
def test_op_gradients_through_kernels_match_torch_path(gpu_dispatch, op):
    fn, *inputs = OP_CASES[op]
    out, grads = value_and_grads(fn, *inputs)
    assert gpu_dispatch, "the op did not reach a kernel"
    with torch_path():
        ref_out, ref_grads = value_and_grads(fn, *inputs)
    torch.testing.assert_close(out, ref_out, **GRAD_TOL)
    for g, ref in zip(grads, ref_grads):
        assert g is not None and ref is not None
        assert_grads_close(g, ref)


def _raw_kernels(monkeypatch):
    """The wrapper disabled: each op returns the kernel's output as is (no autograd)."""
    for mod in OP_MODULES:
        if hasattr(mod, "kernel_op"):  # ops.moe's expert_linear has an autograd Function of its own
            monkeypatch.setattr(mod, "kernel_op", lambda kernel, backward, *inputs: kernel(*inputs))


def test_control_raw_kernels_give_no_gradient(gpu_dispatch, monkeypatch):
    _raw_kernels(monkeypatch)
    for op, (fn, *inputs) in OP_CASES.items():
        _, grads = value_and_grads(fn, *inputs)
        assert all(g is None for g in grads), op


def test_control_a_backward_that_forgets_the_sinks_is_caught(gpu_dispatch, monkeypatch):
    attention_mod = importlib.import_module("nemo_rz.ops.attention")
    fast = attention_mod._attention_fast
    monkeypatch.setattr(attention_mod, "_attention_fast", lambda *a: fast(*a[:-1], None))
    fn, *inputs = OP_CASES["attention_sinks"]
    out, grads = value_and_grads(fn, *inputs)
    with torch_path():
        ref_out, ref_grads = value_and_grads(fn, *inputs)
    torch.testing.assert_close(out, ref_out, **GRAD_TOL)  # the forward is the kernel's: still right
    assert grads[3] is None
    with pytest.raises(AssertionError):
        torch.testing.assert_close(grads[0], ref_grads[0], **GRAD_TOL)


LEARNERS = {
    "dense": dict(vocab_size=64, num_heads=4, num_kv_heads=2),
    # gpt-oss-like: MoE (router and expert biases, clamped SwiGLU), a sliding and a full layer, sinks
    "moe_window_sinks": dict(vocab_size=64, num_heads=4, num_kv_heads=2, num_experts=4, moe_kind="gpt_oss",
                             norm="rms_f32", layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                             attention_sinks=True, attention_bias=True, intermediate_size=64),
}


def _learner_grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.token_logprobs(ids).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", list(LEARNERS))
def test_learner_step_through_kernels_matches_torch_path(gpu_dispatch, kind):
    model = tiny_model(seed=5, **LEARNERS[kind])
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # sinks and biases start at zero: make them count
                p.normal_(0, 0.3)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    on_kernels = _learner_grads(model, ids)
    assert {"linear", "rms_norm", "attention", "token_logprobs", "expert_linear" if "moe" in kind else "silu_and_mul"} <= set(gpu_dispatch)
    with torch_path():
        on_torch = _learner_grads(model, ids)
    for name, g in on_kernels.items():
        assert g is not None and bool(torch.isfinite(g).all()), name
        # measured: within ~4e-6 (~1e-6 of the largest gradient)
        torch.testing.assert_close(g, on_torch[name], rtol=1e-4, atol=5e-5, msg=lambda m: f"{name}: {m}")


def test_control_learner_step_on_raw_kernels_has_no_gradient(gpu_dispatch, monkeypatch):
    _raw_kernels(monkeypatch)
    model = tiny_model(seed=5, vocab_size=64, num_layers=1)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="does not require grad"):
        model.token_logprobs(ids).sum().backward()
