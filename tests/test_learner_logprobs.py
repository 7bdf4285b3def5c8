"""The learner's logprobs: the LM head and log-softmax fused in chunks of rows (ops.lm_head_logprobs), only at the
positions the loss reads, on the batch's packed valid tokens (Decoder.packed): the same bits as the unchunked,
padded computation, and gradients within rounding of it, the same run to run."""
import dataclasses

import pytest
import torch
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models.decoder import packed_rows, unpacked
from nemo_rz.ops.logprobs import head_chunk_rows


def _head(n=77, hidden=64, vocab=4096, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, hidden, generator=g) * 2).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) / 4).to(dtype).requires_grad_()
    return h, w, torch.randint(0, vocab, (n,), generator=g)


def _unfused(h, w, targets, temperature):
    return ops.token_logprobs(ops.linear(h, w), targets, temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_forward_is_the_unfused_one_bit_for_bit(dtype):
    h, w, targets = _head(dtype=dtype)
    temps = [1.0, 0.7, torch.linspace(0.5, 1.5, h.shape[0])]
    for temperature in temps:
        want = _unfused(h, w, targets, temperature)
        for chunk in (1, 5, 32, 76, 77, 100, None):  # N = 77: not a multiple of the chunk, equal to it, below it
            assert torch.equal(ops.lm_head_logprobs(h, w, targets, temperature, chunk=chunk), want), (chunk, temperature)
    with torch.no_grad():
        assert torch.equal(ops.lm_head_logprobs(h, w, targets, 0.7, chunk=32), _unfused(h, w, targets, 0.7))
    assert ops.lm_head_logprobs(h[:0], w, targets[:0]).shape == (0,)
    assert head_chunk_rows(49152) * 49152 * 4 <= ops.logprobs.HEAD_CHUNK_BYTES and head_chunk_rows(49152) % ops.TILE_ROWS == 0


def test_negative_control_another_summation_order_differs():
    """The library's log-softmax (one running sum over the vocabulary, fast kernels) chunked the same way gives
    other bits: the equality above is the row-invariant arithmetic's, not the chunking's."""
    h, w, targets = _head()
    want = _unfused(h, w, targets, 1.0)
    with ops.use_kernels("fast"):
        fast = ops.lm_head_logprobs(h, w, targets, 1.0, chunk=32)
    assert not torch.equal(fast, want) and torch.allclose(fast, want, atol=1e-4)


def test_chunked_gradient_is_close_to_the_unfused_one_and_the_same_run_to_run():
    h, w, targets = _head()
    grad = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(1))
    for temperature in (1.0, 0.7, torch.linspace(0.5, 1.5, h.shape[0])):
        want = torch.autograd.grad(_unfused(h, w, targets, temperature), (h, w), grad)
        for chunk in (5, 32, None):
            got = torch.autograd.grad(ops.lm_head_logprobs(h, w, targets, temperature, chunk=chunk), (h, w), grad)
            again = torch.autograd.grad(ops.lm_head_logprobs(h, w, targets, temperature, chunk=chunk), (h, w), grad)
            for a, b, c in zip(got, want, again):
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-5) and torch.equal(a, c)
    # only the hidden states, or only the weight, asked for
    (gh,) = torch.autograd.grad(ops.lm_head_logprobs(h, w.detach(), targets), (h,), grad)
    assert torch.allclose(gh, torch.autograd.grad(_unfused(h, w.detach(), targets, 1.0), (h,), grad)[0], rtol=1e-4, atol=1e-5)


def test_negative_control_a_wrong_gradient_is_caught():
    """The closeness check sees a gradient off by the temperature (the 1 / T of d logits dropped)."""
    h, w, targets = _head()
    grad = torch.ones(h.shape[0])
    want = torch.autograd.grad(_unfused(h, w, targets, 0.7), (h,), grad)[0]
    wrong = torch.autograd.grad(ops.lm_head_logprobs(h, w, targets, 1.0), (h,), grad)[0]  # T = 1: no 1 / T
    assert not torch.allclose(wrong, want, rtol=1e-4, atol=1e-5)


def _padded_reference(model, ids, lengths, temperature=1.0):
    """The learner's logprobs before packing: the whole padded batch through the layers, the head everywhere."""
    b, length = ids.shape
    hid = model.hidden(model.tokens(ids)).view(b, length, -1)[:, :-1].reshape(b * (length - 1), -1)
    lp = ops.token_logprobs(model.logits(hid), ids[:, 1:].reshape(-1), temperature).view(b, length - 1)
    valid = torch.arange(length - 1)[None, :] < (lengths[:, None] - 1)
    return torch.where(valid, lp, torch.zeros(())), valid


MODELS = {"dense": {}, "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "window": dict(sliding_window=8)}


@pytest.mark.parametrize("kind", MODELS)
def test_packed_and_masked_equal_the_padded_batch_bit_for_bit(kind):
    model = tiny_model(seed=1, **MODELS[kind])
    g = torch.Generator().manual_seed(2)
    ids, lengths = torch.randint(0, 48, (4, 41), generator=g), torch.tensor([41, 17, 33, 2])
    mask = (torch.rand(4, 40, generator=g) > 0.4).float()
    with torch.no_grad():
        want, valid = _padded_reference(model, ids, lengths, 0.8)
        packed = model.token_logprobs(ids, lengths, 0.8)
        masked = model.token_logprobs(ids, lengths, 0.8, mask=mask)
        dense = model.token_logprobs(ids, None, 0.8, mask=mask)
    assert torch.equal(packed, want)
    read = valid & (mask != 0)
    assert torch.equal(masked[read], want[read]) and not masked[~read].any()
    assert torch.equal(dense[mask != 0], model.token_logprobs(ids, None, 0.8)[mask != 0]) and not dense[mask == 0].any()
    assert torch.equal(dense[read], want[read])


def test_negative_control_a_packed_batch_with_wrong_positions_differs():
    model = tiny_model(seed=1)
    ids, lengths = torch.randint(0, 48, (3, 20), generator=torch.Generator().manual_seed(3)), torch.tensor([20, 9, 14])
    t = model.packed(ids, lengths)
    with torch.no_grad():
        right = model.hidden(t)
        assert torch.equal(right, unpacked(right, lengths, 20)[packed_rows(lengths, 20)])
        padded = model.hidden(model.tokens(ids))[packed_rows(lengths, 20)]
        assert torch.equal(right, padded)
        shifted = model.hidden(dataclasses.replace(t, positions=t.positions + 1))
        swapped = model.hidden(dataclasses.replace(t, seq_idx=t.seq_idx.flip(0)))
    assert not torch.equal(shifted, padded) and not torch.equal(swapped, padded)


def test_the_learner_gradient_is_close_to_the_padded_one():
    model = tiny_model(seed=4)
    model.train()
    g = torch.Generator().manual_seed(5)
    ids, lengths = torch.randint(0, 48, (3, 24), generator=g), torch.tensor([24, 13, 19])
    mask = torch.zeros(3, 23)
    for i, n in enumerate(lengths.tolist()):
        mask[i, n // 2 : n - 1] = 1.0
    weights = torch.randn(3, 23, generator=g) * mask

    def grads(lp):
        model.zero_grad(set_to_none=True)
        (lp * weights).sum().backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    want = grads(_padded_reference(model, ids, lengths)[0])
    got = grads(model.token_logprobs(ids, lengths, mask=mask))
    again = grads(model.token_logprobs(ids, lengths, mask=mask))
    for k in want:
        # float32 rounding of another summation order (~7e-6 on AVX2 CPUs; the gradient is not a bit contract)
        assert torch.allclose(got[k], want[k], rtol=1e-4, atol=1e-5), k
        assert torch.equal(got[k], again[k]), k


def test_the_learners_masked_logprobs_equal_the_rollouts():
    model = tiny_model(seed=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    batch = pack(RolloutEngine(model).generate(prompts, SamplingParams(9, temperature=0.9, seed=2)))
    with torch.no_grad():
        lp = model.token_logprobs(batch.input_ids, batch.lengths, 0.9, mask=batch.mask)
    valid = batch.mask.bool()
    assert torch.equal(lp[valid], batch.rollout_logprobs[valid]) and not lp[~valid].any()


def test_bad_input_says_what_to_pass():
    model = tiny_model()
    ids = torch.randint(0, 48, (2, 6))
    with pytest.raises(ValueError, match="one length in 1..6 per row"):
        model.token_logprobs(ids, torch.tensor([6, 7]))
    with pytest.raises(ValueError, match=r"mask is \(2, 6\).*needs \[2, 5\]"):
        model.token_logprobs(ids, None, mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="must be \\[N, H\\], \\[V, H\\] and \\[N\\]"):
        ops.lm_head_logprobs(torch.zeros(3, 8), torch.zeros(10, 4), torch.zeros(3, dtype=torch.long))
