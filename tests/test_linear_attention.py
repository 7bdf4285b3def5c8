"""Gated DeltaNet (models/linear_attention.py, ops/delta_rule.py): decode repeats prefill's arithmetic.

- torch.equal of a full forward's hidden states against prefill(P) + token-by-token decode for P in {1, 63, 64,
  65, 130} (around and across chunk boundaries), and against chunked prefill at chunk sizes that never align
  with the 64-token chunks; the learner's packed batch (a shared prompt run once) equals its dense batch.
- 0 differing tokens between the built-in engine's rollouts and the learner at batch 1 and 16, chunked
  prefill; the learner's logprobs of each completion do not depend on its batch.
- Negative controls: transformers' standard forms (chunked prefill anchored at the call, then token-by-token
  recurrent decode) differ from its own full forward; fast kernels give the rollout and learner different bits.
- One-line refusals: speculative decoding; prefix-cache hits are not taken for these models.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import count_diff

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig

VOCAB = 48


def _model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
               layer_types=["linear_attention", "full_attention"],
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
               norm="gemma", attention_output_gate=True, partial_rotary_factor=0.5, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, shared_expert_intermediate_size=24)
    model = Decoder(DecoderConfig(**{**cfg, **overrides}))
    with torch.no_grad():  # peaky, varied distributions
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv1d" not in name:
                p.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return _model()


def _decode(model, ids: torch.Tensor, prefill: int, chunk: int | None = None) -> torch.Tensor:
    """Hidden states of ids [L] through the cache: the first `prefill` tokens in calls of `chunk` tokens (one call
    when None), then one token per call."""
    cache = model.new_cache(3, 256)
    slot, outs, p = 2, [], 0
    while p < len(ids):
        n = (chunk or prefill) if p < prefill else 1
        n = min(n, prefill - p) if p < prefill else 1
        pos = torch.arange(p, p + n)
        outs.append(model.step(ids[p:p + n], pos, torch.full((n,), slot), cache))
        p += n
    return torch.cat(outs)


def test_prefill_then_decode_equals_the_full_forward(model):
    ids = torch.randint(0, VOCAB, (132,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.hidden(model.tokens(ids[None]))
        for p in (1, 63, 64, 65, 130):
            assert torch.equal(_decode(model, ids, p), full), p
        assert torch.equal(_decode(model, ids, 132, 37), full)  # chunked prefill, never aligned with the chunks


def test_packed_learner_batch_equals_the_dense_one(model):
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (70,), generator=g)
    ids = torch.stack([torch.cat([prompt, torch.randint(0, VOCAB, (30,), generator=g)]) for _ in range(3)])
    lengths = torch.tensor([100, 85, 71])
    with torch.no_grad():
        packed = model.token_logprobs(ids, lengths)
        for b in range(3):
            alone = model.token_logprobs(ids[b:b + 1, : lengths[b]])
            assert torch.equal(packed[b, : lengths[b] - 1], alone[0])


def _prompts(seed: int, n: int, max_len: int, min_len: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in lengths]


def _generate(model, prompts, max_batch_size, prefill_chunk):
    engine = RolloutEngine(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk)
    assert engine.prefix_cache is None  # never a prefix-cache hit for a linear-attention model
    return engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=4, stop_token_ids=(0,)))


@pytest.mark.parametrize("max_batch, chunk", [(1, None), (16, 23)])
def test_engine_matches_learner(model, max_batch, chunk):
    prompts = _prompts(max_batch, max(max_batch, 2), 70, 58)
    prompts[1] = list(prompts[0])  # a same-prompt pair (no twin fork: each computes its prompt)
    outs = _generate(model, prompts, max_batch, chunk)
    diff, total = count_diff(model, outs)
    assert total >= 8 * len(prompts) // 2 and diff == 0


def test_fast_mode_differs(model):
    """Negative control: with library kernels the rollout's logprobs differ from the learner's somewhere."""
    with ops.use_kernels("fast"):
        assert count_diff(model, _generate(model, _prompts(5, 8, 70, 58), 8, 23))[0] > 0


def test_transformers_standard_forms_differ():
    """Negative control: transformers' torch forms, chunked prefill (chunks from the call's start) then recurrent
    decode, give other bits than its chunked forward over the whole sequence: what this scheme avoids."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    g = torch.Generator().manual_seed(3)
    h, length, dk = 2, 140, 16
    q, k = (torch.randn(1, length, h, dk, generator=g) for _ in range(2))
    v = torch.randn(1, length, h, dk, generator=g)
    gate = -torch.rand(1, length, h, generator=g)
    beta = torch.rand(1, length, h, generator=g)
    args = dict(use_qk_l2norm_in_kernel=True)
    full, _ = hf.torch_chunk_gated_delta_rule(q, k, v, gate, beta, **args)
    differ = 0
    for p in (63, 65, 130):
        out, state = hf.torch_chunk_gated_delta_rule(q[:, :p], k[:, :p], v[:, :p], gate[:, :p], beta[:, :p],
                                                      output_final_state=True, **args)
        steps = [out]
        for t in range(p, length):
            o, state = hf.torch_recurrent_gated_delta_rule(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], gate[:, t:t + 1],
                                                           beta[:, t:t + 1], initial_state=state, output_final_state=True, **args)
            steps.append(o)
        differ += not torch.equal(torch.cat(steps, 1), full)
        assert (torch.cat(steps, 1) - full).abs().max() < 1e-4  # the same function, other rounding
    assert differ == 3


def test_refusals_and_state_size(model):
    from nemo_rz.generation.speculative import SpeculativePolicy  # noqa: F401  (exists)

    with pytest.raises(ValueError, match="speculative decoding is not supported for linear-attention"):
        RolloutEngine(model, speculator=object())
    cache = model.new_cache(2, 64)
    cfg = model.config
    per_seq = cache.linear[0].nbytes_per_sequence()
    assert set(cache.linear) == {0} and per_seq == 4 * (4 * 8 * 8 + 4 * 64 * (8 + 8 + 8 + 2) + 3 * (2 * 16 + 32))
    assert all(t.dtype == torch.float32 for t in cache.linear[0].tensors())
    with pytest.raises(ValueError, match="linear_num_value_heads=3 is not a multiple"):
        DecoderConfig(**{**cfg.to_dict(), "linear_num_value_heads": 3})
    if importlib.util.find_spec("vllm") is not None:  # refused before any vLLM engine starts
        from nemo_rz.generation.vllm import VLLMRolloutEngine

        with pytest.raises(ValueError, match="linear-attention .* no recurrent-state cache in the vLLM backend"):
            VLLMRolloutEngine(model, multiprocess=False)


def test_hybrid_tiny_preset_trains_with_zero_kernel_mismatch(tmp_path):
    from conftest import preset_run

    saved, rows = preset_run("hybrid_tiny", tmp_path / "run", "runtime.rollout_kernels=consistent")
    assert "linear_attention" in saved and len(rows) == 3
    assert all(r["kernel_diff_tokens"] == 0 and r["tokens"] > 0 for r in rows)
