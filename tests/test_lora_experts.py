"""LoRA on MoE experts (nemo_rz.models.lora): per-expert A and B (or a shared A, B per expert) on the stacked expert
products of Qwen3-MoE, Qwen2-MoE (shared expert beside) and DeepSeek-V3 (routed experts), through the experts'
row-invariant products. The learner and the built-in engine agree bitwise after adapter-only updates, at batch 1
and 16; a version ships the expert adapters with the others; PEFT's `target_parameters` adapters load with equal
outputs and saved ones load into peft. Negative controls: fast kernels, a merged-weight refit, the adapter left out,
a shared A made per-expert."""
import pytest
import torch
from conftest import count_diff

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import Decoder, DecoderConfig, lora
from nemo_rz.runtime.learner import Learner
from nemo_rz.runtime.weights import SharedWeightRing

BASE = dict(vocab_size=48, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)
FAMILIES = {  # (model config, dtype, LoRA spec)
    "qwen3-moe": (dict(moe_kind="qwen3"), "float32", dict(rank=4, alpha=8.0, modules="all")),
    "qwen2-moe-shared-a": (dict(moe_kind="qwen3", shared_expert_intermediate_size=40, qk_norm=False, attention_bias=True),
                           "bfloat16", dict(rank=4, alpha=8.0, modules="experts", expert_a="shared")),
    "deepseek-v3": (dict(num_kv_heads=1, qk_norm=False, attention_kind="mla", q_lora_rank=24, kv_lora_rank=32,
                         qk_nope_head_dim=16, v_head_dim=24, num_experts=8, moe_kind="deepseek", n_group=2, topk_group=1,
                         n_shared_experts=1, routed_scaling_factor=2.5, moe_layers=[1]),
                    "bfloat16", dict(rank=4, alpha=8.0, modules="experts.down_proj,experts.gate_up_proj,down_proj")),
}


def _model(family: str, seed: int = 0, lora_seed: int = 0) -> Decoder:
    cfg, dtype, spec = FAMILIES[family]
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(**{**BASE, **cfg, "dtype": dtype}))
    with torch.no_grad():  # peaky, varied distributions (as conftest.tiny_model), the experts too
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return lora.apply_lora(model.eval(), spec, seed=lora_seed)


def _prompts(seed: int, n: int, max_len: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in torch.randint(1, max_len + 1, (n,), generator=g)]


def _step(learner, completions):
    learner.rl_step(pack(completions), torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(completions))]))


def _expert_adapters(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in lora.adapter_state(model).items() if ".experts.adapters." in k}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_adapters_follow_adapter_only_updates_with_zero_mismatch(family):
    """Two RL updates of the adapters (experts' included) on the learner, each shipped to the engine as the adapters
    alone: 0 differing tokens at batch 1 and 16. Negative controls: the merged refit W + scale * B @ A on the base's
    grid, and fast kernels, differ."""
    learner_model = _model(family)
    learner = Learner(learner_model, 0.05, 1.0, 1.0, "reinforce_zero", "none", {})
    engine_model = _model(family, lora_seed=1)  # other A: the first update replaces them
    engine = RolloutEngine(engine_model, max_batch_size=16)
    engine.update_weights(learner_model.state_dict(), 0)
    before = {k: v.clone() for k, v in _expert_adapters(learner_model).items()}
    for version in (1, 2):
        _step(learner, engine.generate(_prompts(version, 8), SamplingParams(5, seed=version)))
        update = {k: v.detach().clone() for k, v in lora.adapter_state(learner_model).items()}
        engine.update_weights(update, version)
    after = _expert_adapters(learner_model)
    assert after and all(not torch.equal(before[k], v) for k, v in after.items()), "every expert adapter trains"
    if FAMILIES[family][2].get("expert_a") == "shared":
        assert all(v.dim() == 2 for k, v in after.items() if "lora_A" in k)
    for n in (1, 16):
        outs = RolloutEngine(engine_model, max_batch_size=n).generate(_prompts(20 + n, n), SamplingParams(6, seed=n))
        diff, total = count_diff(learner_model, outs)
        assert total > 0 and diff == 0, f"{family}, batch {n}: {diff} of {total} tokens differ"
    outs = engine.generate(_prompts(9, 16), SamplingParams(6, seed=9))
    assert {c.weight_version for c in outs} == {2} and count_diff(learner_model, outs)[0] == 0
    # negative control: the merged-weight refit (experts' W + scale * B_e @ A_e rounded to the base's dtype)
    merged = _model(family)
    merged.load_state_dict({**lora.merged_state(learner_model), **{k: torch.zeros_like(v) for k, v in lora.adapter_state(merged).items()}})
    diff, total = count_diff(learner_model, RolloutEngine(merged, max_batch_size=16).generate(_prompts(9, 16), SamplingParams(6, seed=9)))
    assert diff > 0, f"merged refit ({family}): {diff} of {total} tokens differ"
    with ops.use_kernels("fast"):  # negative control: the engine on library kernels, the learner consistent
        outs = RolloutEngine(engine_model, max_batch_size=16, prefill_chunk=4).generate(_prompts(9, 16), SamplingParams(6, seed=9))
    assert count_diff(learner_model, outs)[0] > 0, "negative control: library kernels should differ"


def test_quantized_experts_with_float32_expert_adapters_have_zero_mismatch():
    """mxfp8 experts (a precision recipe's QuantizedExperts) with expert LoRA on top: the adapter's term is
    expert_adapter_product of the rows before quantization and the raw float32 A and B, and after an update the
    engine records the learner's logprobs at batch 1 and 16. Negative control: fast kernels in the engine."""
    from nemo_rz.quant.apply import apply_precision
    from nemo_rz.quant.experts import QuantizedExperts

    def model(lora_seed):
        torch.manual_seed(0)
        m = Decoder(DecoderConfig(**{**BASE, "moe_kind": "qwen3", "dtype": "bfloat16"}))
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.3)
        m = apply_precision(m.eval(), {"recipe": "mxfp8", "modules": "experts"})
        return lora.apply_lora(m, dict(rank=4, alpha=8.0, modules="experts"), seed=lora_seed)

    learner_model, engine_model = model(0), model(1)
    learner = Learner(learner_model, 0.05, 1.0, 1.0, "reinforce_zero", "none", {})
    engine = RolloutEngine(engine_model, max_batch_size=16)
    engine.update_weights(learner_model.state_dict(), 0)
    _step(learner, engine.generate(_prompts(1, 8), SamplingParams(5, seed=1)))
    engine.update_weights({k: v.detach().clone() for k, v in lora.adapter_state(learner_model).items()}, 1)
    experts = learner_model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts.adapters["down_proj"].lora_B.weight.abs().sum() > 0
    g = torch.Generator().manual_seed(2)
    x, which = torch.randn(6, 64, generator=g).to(torch.bfloat16), torch.randint(0, 4, (6, 2), generator=g)
    weights = torch.full((6, 2), 0.5)
    with torch.no_grad():
        adapted = experts(x, which, weights)
        experts.product_hook = None
        plain = experts(x, which, weights)
        rows, flat = x.repeat_interleave(2, dim=0), which.reshape(12)
        a, b = experts.adapters["gate_up_proj"].lora_A.weight, experts.adapters["gate_up_proj"].lora_B.weight
        term = lora.expert_adapter_product(rows, flat, a, b, experts.lora_scale)
        experts.product_hook = lora._add_expert_adapter
        hooked = experts._product("gate_up_proj", rows, flat, None, torch.bfloat16)
        experts.product_hook = None
        assert torch.equal(hooked, experts._product("gate_up_proj", rows, flat, None, torch.bfloat16) + term)
        experts.product_hook = lora._add_expert_adapter
    assert not torch.equal(adapted, plain)
    for n in (1, 16):
        outs = RolloutEngine(engine_model, max_batch_size=n).generate(_prompts(30 + n, n), SamplingParams(5, seed=n))
        diff, total = count_diff(learner_model, outs)
        assert total > 0 and diff == 0, f"batch {n}: {diff} of {total} tokens differ"
    with ops.use_kernels("fast"):
        outs = RolloutEngine(engine_model, max_batch_size=16, prefill_chunk=4).generate(_prompts(9, 16), SamplingParams(5, seed=9))
    assert count_diff(learner_model, outs)[0] > 0, "negative control: library kernels should differ"


def test_the_expert_product_follows_its_schedule_and_a_fresh_adapter_changes_nothing():
    """expert_adapter_product row by row against its schedule written out per expert; B = 0 leaves the model's bits;
    per-row results do not depend on the other rows (the product's row invariance)."""
    model = _model("qwen3-moe")
    plain = Decoder(model.config)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not lora.is_adapter(k)})
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.token_logprobs(ids), plain.eval().token_logprobs(ids))
    g = torch.Generator().manual_seed(3)
    for dtype, shared in ((torch.float32, False), (torch.bfloat16, True)):
        a = torch.randn(4, 64, generator=g) if shared else torch.randn(4, 4, 64, generator=g)
        b = torch.randn(4, 32, 4, generator=g)
        rows, which = torch.randn(37, 64, generator=g).to(dtype), torch.randint(0, 4, (37,), generator=g)
        got = lora.expert_adapter_product(rows, which, a, b, 2.0)
        for m in range(37):
            a_e = a if shared else a[which[m]]
            t = (rows[m].float() @ a_e.t() * 2.0).to(dtype).float()
            expect = (t @ b[which[m]].t()).to(dtype)
            assert (got[m].float() - expect.float()).abs().max() <= 1e-5 + 2 ** -7 * expect.float().abs().max()
        part = lora.expert_adapter_product(rows[5:9], which[5:9], a, b, 2.0)
        assert torch.equal(part, got[5:9]), "a row's bits depend on the other rows"
    with torch.no_grad():  # a trained adapter changes the output
        for v in _expert_adapters(model).values():
            v.normal_(0, 0.3)
        assert not torch.equal(model.token_logprobs(ids), plain.token_logprobs(ids))


def test_a_version_ships_the_expert_adapters_and_the_learner_trains_them_alone():
    model = _model("qwen2-moe-shared-a")
    learner = Learner(model, 0.05, 1.0, 1.0, "reinforce_zero", "none", {})
    first = learner.weights(0)
    static = set(first.static_names())
    experts = _expert_adapters(model)
    assert experts and not static & set(experts) and ".experts.gate_up_proj" in " ".join(static)
    held = {id(p) for g in learner.opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if lora.is_adapter(n)}
    ring = SharedWeightRing(first.flat(), 2, first.static_names())
    adapter_bytes = sum(v.numel() * v.element_size() for v in lora.adapter_state(model).values())
    assert ring.publish(0, first.flat()) == adapter_bytes
    a, b = (experts[f"model.layers.0.mlp.experts.adapters.gate_up_proj.{x}.weight"] for x in ("lora_A", "lora_B"))
    assert a.shape == (4, 64) and b.shape == (4, 64, 4) and a.dtype == b.dtype == torch.float32  # bf16 base, f32 adapter
    assert all(v.dtype == torch.float32 for k, v in first.to(torch.bfloat16).policy.items() if lora.is_adapter(k))


def test_expert_lora_settings_and_updates_are_one_line():
    with pytest.raises(ValueError, match="lora.expert_a = 'both'"):
        lora.LoraSpec(4, modules="experts", expert_a="both")
    with pytest.raises(ValueError, match="lora.modules = 'experts.up_proj'"):
        lora.LoraSpec(4, modules="experts.up_proj")
    assert lora.LoraSpec(4, modules="experts").targets == lora.EXPERTS
    assert set(lora.LoraSpec(4, modules="all").targets) >= set(lora.EXPERTS)
    with pytest.raises(ValueError, match="no such linear layers or MoE experts"):
        from conftest import tiny_model
        lora.apply_lora(tiny_model(), dict(rank=4, modules="experts"))
    model = _model("qwen3-moe")
    update = {k: v.clone() for k, v in lora.adapter_state(model).items()}
    name = next(k for k in update if ".experts." in k)
    update[name] = update[name][:, :2]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        lora.load_weights(model, update)


# -- PEFT target_parameters ---------------------------------------------------------------------------------------
peft_marks = pytest.mark.skipif(__import__("importlib").util.find_spec("peft") is None, reason="peft not installed")


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("peft_moe") / "base"
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        lp = torch.log_softmax(model(IDS).logits.float(), -1)
    return lp[:, :-1].gather(-1, IDS[:, 1:, None])[..., 0]


def _rz_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        return model.token_logprobs(IDS, torch.tensor([12, 12]))


@peft_marks
@pytest.mark.parametrize("targets", [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ["mlp.experts.down_proj"]])
def test_a_peft_expert_adapter_loads_with_equal_outputs(moe_base, tmp_path, targets):
    import peft

    from nemo_rz.models.hf import load_hf

    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj"], target_parameters=targets, lora_dropout=0.0,
                             init_lora_weights=False)
    torch.manual_seed(2)
    tuned = peft.get_peft_model(_hf(moe_base), config)
    tuned.save_pretrained(tmp_path / "adapter")
    expect = _hf_logprobs(tuned)
    spec, _ = lora.load_peft(tmp_path / "adapter")
    assert set(spec.targets) == {"q_proj"} | {t.split(".", 1)[1] for t in targets}
    model = lora.apply_lora(load_hf(moe_base, "float32"), spec)
    plain = _rz_logprobs(model)
    lora.init_from(model, tmp_path / "adapter")
    got = _rz_logprobs(model)
    assert (got - expect).abs().max() < 1e-4
    assert (plain - expect).abs().max() > 1e-2  # negative control: without the adapter
    with pytest.raises(ValueError, match="lora.expert_a=per_expert"):
        shared = lora.apply_lora(load_hf(moe_base, "float32"), {**spec.as_dict(), "expert_a": "shared"})
        lora.init_from(shared, tmp_path / "adapter")


@peft_marks
@pytest.mark.parametrize("expert_a", ["per_expert", "shared"])
def test_a_saved_expert_adapter_loads_into_peft_with_equal_outputs(moe_base, tmp_path, expert_a):
    import peft

    from nemo_rz.models.hf import load_hf

    model = lora.apply_lora(load_hf(moe_base, "float32"), dict(rank=4, alpha=8.0, modules="v_proj,experts",
                                                               expert_a=expert_a), seed=3)
    with torch.no_grad():
        for k, v in lora.adapter_state(model).items():
            v.normal_(0, 0.1 if "lora_B" in k else 0.3)
    lora.save_peft(model, tmp_path / "out", base_model=str(moe_base))
    loaded = peft.PeftModel.from_pretrained(_hf(moe_base), tmp_path / "out").eval()
    assert (_hf_logprobs(loaded) - _rz_logprobs(model)).abs().max() < 1e-4
    assert (_hf_logprobs(_hf(moe_base)) - _rz_logprobs(model)).abs().max() > 1e-2  # negative control: peft's base
    spec, tensors = lora.load_peft(tmp_path / "out")  # and back: a shared A comes back once per expert
    back = lora.apply_lora(load_hf(moe_base, "float32"), spec)
    lora.load_weights(back, tensors)
    assert (_rz_logprobs(back) - _rz_logprobs(model)).abs().max() < 1e-5


def test_the_memory_bound_counts_the_expert_adapters():
    """schema.lora_params on an MoE shape: rank x (E * out + E * in) per expert product, one A with expert_a=shared;
    attention alone leaves them out (by hand for hidden 8, moe_inter 8, 4 experts, 2 layers, rank 2)."""
    from nemo_rz import schema

    shape = schema.Shape(hidden=8, inter=16, layers=2, heads=2, kv=1, head_dim=4, vocab=10, positions=64, experts=4,
                         topk=2, moe_inter=8)
    per_expert = 2 * 2 * ((4 * 16 + 4 * 8) + (4 * 8 + 4 * 8))  # layers x rank x (gate_up: E*2I + E*H; down: E*H + E*I)
    shared = 2 * 2 * ((4 * 16 + 8) + (4 * 8 + 8))
    assert schema.lora_params(dict(rank=2, modules="experts"), shape) == per_expert == 640
    assert schema.lora_params(dict(rank=2, modules="experts", expert_a="shared"), shape) == shared == 448
    attention = schema.lora_params(dict(rank=2, modules="attention"), shape)
    assert schema.lora_params(dict(rank=2, modules="all"), shape) == attention + per_expert
    assert schema.lora_params(dict(rank=2, modules="q_proj,experts.down_proj"), shape) == 2 * 2 * (8 + 8) + 2 * 2 * 64
