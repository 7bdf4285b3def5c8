"""nemo_rz.ops in consistent mode dispatches to the Triton kernels on CUDA tensors, and both paths agree.

No GPU here: the dispatch predicate is forced on for CPU tensors and the kernels run under the Triton
interpreter, which exercises the real call path (argument order, shapes, dtypes) end to end.
"""
import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import torch  # noqa: E402

import importlib  # noqa: E402

from conftest import count_diff, tiny_model  # noqa: E402
from nemo_rz import kernels  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402

pytestmark = pytest.mark.kernels
# importlib: the package re-exports functions under the same names as these modules
OP_MODULES = [importlib.import_module(f"nemo_rz.ops.{m}") for m in ("linear", "norm", "activation", "logprobs", "attention")]
consistent = importlib.import_module("nemo_rz.ops.mode").consistent


@pytest.fixture
def gpu_dispatch(monkeypatch):
    """Route consistent ops to nemo_rz.kernels as on CUDA, and count the kernel calls."""
    calls = []
    for name in ("linear", "rms_norm", "silu_and_mul", "log_softmax", "token_logprobs", "attention"):
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
    outs = RolloutEngine(model, max_batch_size=4).generate([[1, 2, 3], [4] * 9, [5, 6]], SamplingParams(6, seed=1))
    assert count_diff(model, outs)[0] == 0  # the kernels are batch-invariant on their own
