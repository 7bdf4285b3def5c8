"""A Linear weight is one tensor: the usual [N, K] parameter over contiguous [K, N] storage (models/layers.py), so
the consistent GEMM route reads `weight.t()` itself and keeps no [K, N] copy; everything else (logprobs, Adam,
state dicts, Hugging Face files, in-place loaders) sees what it saw with a contiguous [N, K] weight."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from nemo_rz.kernels import cpu as cpu_kernels
from nemo_rz.models import Decoder, load_hf, save_hf
from nemo_rz.models.layers import Linear
from nemo_rz.ops import weight_cache


def _usual(model: Decoder) -> Decoder:
    """The negative control: the same model with every Linear weight a contiguous [N, K] parameter."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.weight = torch.nn.Parameter(m.weight.detach().contiguous())
    return model


def _linears(model: Decoder) -> list[torch.Tensor]:
    return [m.weight for m in model.modules() if isinstance(m, Linear)]


def _copies(model: Decoder) -> int:
    return sum(len(p.__dict__.get(weight_cache.ATTR, {})) for p in _linears(model))


def _pair(seed: int = 0, **cfg) -> tuple[Decoder, Decoder]:
    model = tiny_model(seed, tie_word_embeddings=False, **cfg)
    usual = _usual(tiny_model(seed, tie_word_embeddings=False, **cfg))
    usual.load_state_dict(model.state_dict())
    return model, usual


def _in_layout(w: torch.Tensor) -> bool:
    return w.dim() == 2 and w.t().is_contiguous() and not w.is_contiguous()


def test_a_linear_weight_is_n_by_k_over_k_by_n_storage():
    lin = Linear(6, 10, True, torch.float32)
    assert lin.weight.shape == (10, 6) and lin.weight.stride() == (1, 10) and _in_layout(lin.weight)
    assert list(lin.state_dict()) == ["weight", "bias"] and lin.state_dict()["weight"].shape == (10, 6)
    usual = _usual(tiny_model())
    assert not any(_in_layout(w) for w in _linears(usual))  # the control is built the other way


def test_float32_linears_keep_no_copy_and_give_the_same_bits():
    model, usual = _pair()
    assert all(_in_layout(w) for w in _linears(model))
    ids = torch.randint(0, 48, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        lp, lp_usual = model.token_logprobs(ids), usual.token_logprobs(ids)
        one, one_usual = model.token_logprobs(ids[:1]), usual.token_logprobs(ids[:1])  # batch 1: the matvec route
    assert torch.equal(lp, lp_usual) and torch.equal(one, one_usual)
    assert _copies(model) == 0
    assert _copies(usual) == len(_linears(usual))  # negative control: a [N, K] weight makes its [K, N] copy


def test_bfloat16_weights_are_read_as_stored():
    """A bfloat16 weight in the layout goes to the C++ rows_mm kernel (tests/test_bf16.py): no float32 copy, the
    same bits as the usual layout's copy. Negative control: the usual [N, K] weight still makes its copy."""
    model, usual = _pair(dtype="bfloat16")
    ids = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model.token_logprobs(ids), usual.token_logprobs(ids))
        assert torch.equal(model.token_logprobs(ids[:1]), usual.token_logprobs(ids[:1]))
    assert _copies(model) == (0 if cpu_kernels.available() else len(_linears(model)))
    assert _copies(usual) == len(_linears(usual))


def test_a_tied_embedding_is_its_own_lm_head_operand():
    """With tied embeddings the embedding is laid out as a Linear weight: the LM head reads it with no copy, and
    lookups, logprobs and state dicts are those of the usual contiguous embedding. Negative control: the usual
    embedding makes its [K, N] copy."""
    model = tiny_model(tie_word_embeddings=True)
    usual = tiny_model(tie_word_embeddings=True)
    emb = usual.model.embed_tokens
    emb.weight = torch.nn.Parameter(emb.weight.detach().contiguous())
    usual.load_state_dict(model.state_dict())
    assert _in_layout(model.head_weight) and model.head_weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 48, (3, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(model.token_logprobs(ids), usual.token_logprobs(ids))
    assert weight_cache.ATTR not in model.head_weight.__dict__
    assert "gemm.t" in usual.head_weight.__dict__[weight_cache.ATTR]


def test_adam_steps_are_bitwise_those_of_the_usual_layout():
    model, usual = _pair()
    model.train(), usual.train()
    ids = torch.randint(0, 48, (3, 9), generator=torch.Generator().manual_seed(3))
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, usual)]
    for _ in range(2):
        for m, opt in zip((model, usual), opts):
            (-m.token_logprobs(ids).sum()).backward()
            grads = {n: p.grad.clone() for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad(set_to_none=True)
            m.grads = grads
        for n in model.grads:  # the same gradients (the backward's products are the same library calls) ...
            assert torch.equal(model.grads[n], usual.grads[n]), n
    for (n, p), q in zip(model.named_parameters(), usual.parameters()):  # ... and the same update
        assert torch.equal(p, q), n
    assert all(_in_layout(w) for w in _linears(model))  # the optimizer wrote in place


def test_hugging_face_round_trip_keeps_values_and_layout(tmp_path):
    model, _ = _pair()
    save_hf(model, tmp_path / "m")
    loaded = load_hf(tmp_path / "m")
    assert all(_in_layout(w) for w in _linears(loaded))
    for (n, p), q in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(p, q), n
    ids = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model.token_logprobs(ids), loaded.token_logprobs(ids))
    assert _copies(loaded) == 0


@pytest.mark.parametrize("write", ["data_copy", "replace_data"])
def test_writes_through_data_are_seen(write):
    """vLLM's loaders copy into `.data`: the storage is the GEMM operand, so the write is seen with no forget. A
    replaced `.data` loses the layout: the weight then gets a copy again, made from the new values."""
    model, _ = _pair()
    other, _ = _pair(seed=7)
    ids = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        model.token_logprobs(ids)
        for (n, p), new in zip(model.named_parameters(), other.parameters()):
            if write == "data_copy":
                p.data.copy_(new)
            else:
                p.data = new.detach().contiguous().clone()
        assert torch.equal(model.token_logprobs(ids), other.token_logprobs(ids))
    assert _copies(model) == (0 if write == "data_copy" else len(_linears(model)))
