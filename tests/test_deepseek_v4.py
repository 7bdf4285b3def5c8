"""The DeepSeek-V4 family (DeepseekV4ForCausalLM): sliding / compressed sparse (CSA, lightning indexer) /
heavily compressed (HCA) attention with sinks, hyper-connections, hash and top-k MoE.

- Parity: a random tiny checkpoint built with transformers' DeepseekV4Config (all three layer types, hash and
  top-k MoE layers, 40-token prompts: past the 8-token window, 10 CSA and 5 HCA entries) loads with logits
  within 1e-4 of transformers' float32 model and saves back in a form transformers loads (bit-exact round trip).
  Negative control: a compressor's position bias changed gives a visible difference.
- One arithmetic: prefill of P tokens then decode equals the full forward bit for bit for P across compression
  and window boundaries; the learner's packed batch equals its dense one; the indexer's tie rule.
- Zero mismatch on the built-in engine at batch 1 and 8 (chunked prefill); fast kernels differ.
"""
from __future__ import annotations

import pytest
import torch
from conftest import count_diff, learner_routing, preset_run, rollout_routing

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import load_hf, save_hf

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
BASE = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
            head_dim=16, q_lora_rank=16, partial_rotary_factor=0.5, num_experts_per_tok=2, n_routed_experts=4,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=2,
            hc_sinkhorn_iters=5, mlp_layer_types=["hash_moe", "moe", "moe", "hash_moe"], sliding_window=8, o_groups=2,
            o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3, max_position_embeddings=256)


def randomized(model, g: torch.Generator) -> None:
    """Non-trivial values in a transformers V4 model: sinks, position biases, hyper-connection biases and scales,
    the selection bias, a random hash table (8 indexer heads: exact score ties, where transformers' top-k order
    is unspecified, are rare)."""
    cfg = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")) or "scale" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                     for _ in range(cfg.vocab_size)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, nemo_rz's loaded from its save_pretrained directory, that directory)."""
    cfg = transformers.DeepseekV4Config(**BASE)
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(cfg).eval()
    randomized(hf, torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("dsv4") / "ckpt"
    hf.save_pretrained(path)
    return hf, load_hf(path), path


def _ids(batch: int = 2, length: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_matches_transformers_and_round_trips(pair, tmp_path):
    hf, ours, _ = pair
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids, use_cache=False).logits
        got = ours(ids)
    assert (ref - got).abs().max() < TOL
    assert [t for t in ours.config.deepseek_v4["layer_types"]] == BASE["layer_types"]
    save_hf(ours, tmp_path / "saved")
    back = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        assert torch.equal(back(ids, use_cache=False).logits, ref)
        assert torch.equal(load_hf(tmp_path / "saved")(ids), got)


def test_negative_control_the_parity_bound_can_fail(pair):
    hf, ours, path = pair
    model = load_hf(path)
    with torch.no_grad():
        model.model.layers[2].self_attn.compressor.position_bias[0].add_(1.0)  # the HCA window weights of slot 0
        ids = _ids()
        assert (hf(ids, use_cache=False).logits - model(ids)).abs().max() > 1e-3


def test_prefill_then_decode_is_the_full_forward_bit_for_bit(pair):
    """A prompt's first P tokens in one step, then the rest one token a step, against (and into) the engine's
    cache: every row's hidden state has the full forward's bits, for P at the CSA rate (4; decode then crosses
    the HCA rate and the window, 8, and more CSA boundaries) and past them all (13)."""
    _, model, _ = pair
    ids = _ids(1, 18, seed=3)[0]
    with torch.no_grad():
        full = model.hidden(model.tokens(ids[None]))
        for p in (4, 13):
            cache = model.new_cache(1, 18)
            zero = torch.zeros(p, dtype=torch.long)
            rows = [model.step(ids[:p], torch.arange(p), zero, cache)]
            for pos in range(p, 18):
                rows.append(model.step(ids[pos: pos + 1], torch.tensor([pos]), torch.zeros(1, dtype=torch.long), cache))
            assert torch.equal(torch.cat(rows), full), p


def test_packed_learner_batch_is_the_dense_one(pair):
    _, model, _ = pair
    ids = _ids(3, 33, seed=5)
    ids[1, :20] = ids[0, :20]  # a shared prefix: run once in the packed batch
    lengths = torch.tensor([33, 29, 12])
    with torch.no_grad():
        dense = model.token_logprobs(ids)
        packed = model.token_logprobs(ids, lengths)
    for b, n in enumerate(lengths.tolist()):
        assert torch.equal(packed[b, : n - 1], dense[b, : n - 1])


def test_indexer_ties_go_to_the_lower_entry():
    from nemo_rz.models import deepseek_v4

    scores = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.5]])
    chosen = torch.sort(scores, dim=1, descending=True, stable=True)[1][:, :2]
    assert chosen.tolist() == [[1, 3]]  # the rule Indexer.select documents and uses
    assert "lower entry index wins" in deepseek_v4.__doc__


# -- zero mismatch on the built-in engine ------------------------------------------------------------------
def _prompts(seed: int, n: int, max_len: int, min_len: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, 64, (int(k),), generator=g).tolist() for k in lengths]


def _generate(model, prompts, max_batch_size, prefill_chunk):
    engine = RolloutEngine(model, max_batch_size=max_batch_size, prefill_chunk=prefill_chunk, max_model_len=64)
    return engine.generate(prompts, SamplingParams(max_new_tokens=12, seed=4, stop_token_ids=(1,)))


@pytest.mark.parametrize("max_batch, chunk", [(1, None), (8, 5)])
def test_engine_matches_learner(pair, max_batch, chunk):
    """0 differing tokens; with 5-token prefill chunks the window keys and the compressors' rows are rings of 32
    of the cache's 64 positions, and prompts of up to 30 tokens plus 12 generated ones wrap them."""
    _, model, _ = pair
    if chunk is not None:
        cache = model.new_cache(max_batch, 64, step_tokens=chunk)
        assert cache.k[1].shape[2] == cache.compressed.rows[1]["kv"].shape[1] == 32 < cache.max_len
    outs = _generate(model, _prompts(max_batch, max_batch + 2, 30, 6), max_batch, chunk)
    diff, total = count_diff(model, outs)
    assert total > 0 and diff == 0


def test_routing_matches_and_fast_mode_differs(pair):
    """Every token's experts equal between the learner's batch and the rollout's steps; with library kernels the
    rollout's logprobs differ from the learner's (the negative control)."""
    _, model, _ = pair
    ids = _ids(4, 24, seed=8)
    learner, rollout = learner_routing(model, ids), rollout_routing(model, ids, [1, 5, 2, 9])
    assert learner.keys() == rollout.keys() and all(learner[k] == rollout[k] for k in learner)
    with ops.use_kernels("fast"):
        assert count_diff(model, _generate(model, _prompts(5, 12, 30, 10), 8, 7))[0] > 0


# -- training ---------------------------------------------------------------------------------------------
def test_deepseek_v4_tiny_preset_trains_with_zero_mismatch(tmp_path):
    """`python -m nemo_rz.train --config deepseek_v4_tiny` (sliding, CSA and HCA layers, hash and top-k MoE)
    trains: every update's rollout logprobs and expert choices equal the learner's. (The negative control, fast
    kernels differing on a V4 model, is test_routing_matches_and_fast_mode_differs.)"""
    saved, rows = preset_run("deepseek_v4_tiny", tmp_path / "run", "runtime.rollout_kernels=consistent")
    assert "attention_kind: deepseek_v4" in saved and "heavily_compressed_attention" in saved
    assert len(rows) == 3
    assert all(r["kernel_diff_tokens"] == 0 and r["routing_diff_tokens"] == 0 and r["tokens"] > 0 for r in rows)


def test_gradients_reach_every_parameter_but_the_indexer(pair):
    """The learner's loss reaches every weight except the lightning indexer's, whose top-k selection is discrete
    (as in transformers: the indexer is trained by its own objective, not by the LM loss)."""
    _, _, path = pair
    model = load_hf(path).train()
    for p in model.parameters():
        p.requires_grad_(True)
    model.token_logprobs(_ids(2, 30), torch.tensor([30, 22])).sum().backward()
    silent = {n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)}
    assert silent and all(".indexer." in n for n in silent)


# -- what this increment refuses, in one line each -----------------------------------------------------------
def test_vllm_and_quantization_refuse_v4_in_one_line(pair, tmp_path):
    import json
    import shutil

    from nemo_rz.quant.apply import apply_precision

    _, model, path = pair
    with pytest.raises(ValueError, match="DeepSeek-V4 models are not quantized yet") as e:
        apply_precision(load_hf(path), "fp8_block")
    assert "\n" not in str(e.value)
    assert apply_precision(model, "none") is model  # the control: no recipe, nothing refused
    quantized = tmp_path / "fp8"
    shutil.copytree(path, quantized)
    d = json.loads((quantized / "config.json").read_text())
    d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (quantized / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="quantized DeepSeek-V4 checkpoint"):
        load_hf(quantized)
    backend = pytest.importorskip("nemo_rz.generation.vllm.backend")
    with pytest.raises(ValueError, match="DeepSeek-V4 .* is not in the vLLM backend yet") as e:
        backend.VLLMRolloutEngine(model)
    assert "\n" not in str(e.value)
    from nemo_rz.tools.serve import serve_command

    with pytest.raises(ValueError, match="DeepSeek-V4 .* is not in the vLLM backend yet"):  # the server: the same check
        serve_command(path)
