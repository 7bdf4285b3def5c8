"""LoRA (nemo_rz.models.lora): adapters inside nemo-rz's consistent ops on the learner and the built-in engine, the
base frozen, adapter-only weight versions, and the config seam. Negative controls: fast kernels, a merged-weight
refit (W + scale * B @ A on the base's grid), full fine-tuning (the base moves, every tensor ships)."""
import dataclasses
import json

import pytest
import torch
from conftest import count_diff, tiny_model

from nemo_rz import config, ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import lora
from nemo_rz.runtime import build
from nemo_rz.runtime.learner import Learner
from nemo_rz.runtime.weights import SharedWeightRing
from nemo_rz.runtime.worker import RolloutWorker

SPEC = dict(rank=4, alpha=8.0, modules="all")


def _model(dtype="float32", seed=0, spec=SPEC):
    return lora.apply_lora(tiny_model(seed, dtype=dtype), spec, seed=seed)


def _prompts(seed: int, n: int, max_len: int = 16) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in torch.randint(1, max_len + 1, (n,), generator=g)]


def _learner(model, lr=0.05):
    return Learner(model, lr, 1.0, 1.0, "reinforce_zero", "none", {})


def _train_step(learner, completions):
    """One RL update on `completions` with fixed advantages (+1 / -1 alternately)."""
    batch = pack(completions)
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(completions))])
    learner.rl_step(batch, adv)


def _adapter_copy(model):
    return {k: v.detach().clone() for k, v in lora.adapter_state(model).items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_follows_adapter_only_updates_with_zero_mismatch(dtype):
    """Many adapter updates, batch 1 to 64: the engine's recorded logprobs equal the learner's bitwise; the engine
    receives the adapters alone. Negative control: the merged-weight refit of the same adapters differs."""
    learner_model = _model(dtype)
    learner = _learner(learner_model)
    engine_model = _model(dtype, seed=1)  # other adapters and A: the first update replaces them
    engine_model.load_state_dict(learner_model.state_dict())
    engine = RolloutEngine(engine_model, max_batch_size=64)
    for version in range(1, 5):
        completions = engine.generate(_prompts(version, 8), SamplingParams(6, seed=version))
        _train_step(learner, completions)
        engine.update_weights(_adapter_copy(learner_model), version)
    assert any(v.abs().sum() > 0 for k, v in lora.adapter_state(learner_model).items() if "lora_B" in k)
    for n, batch in ((1, 1), (5, 3), (64, 64)):
        outs = RolloutEngine(engine_model, max_batch_size=batch).generate(_prompts(100 + n, n, 20), SamplingParams(8, seed=n))
        assert {c.weight_version for c in outs} == {0}
        diff, total = count_diff(learner_model, outs)
        assert total > 0 and diff == 0
    outs = engine.generate(_prompts(7, 24), SamplingParams(8, seed=3))
    assert {c.weight_version for c in outs} == {4} and count_diff(learner_model, outs)[0] == 0
    # negative control: W + scale * B @ A rounded to the base's dtype, run by a plain model, as a merged refit ships
    merged = tiny_model(dtype=dtype)
    merged.load_state_dict(lora.merged_state(learner_model))
    outs_m = RolloutEngine(merged, max_batch_size=8).generate(_prompts(7, 24), SamplingParams(8, seed=3))
    diff, total = count_diff(learner_model, outs_m)
    assert diff > 0, f"merged refit ({dtype}): {diff} of {total} tokens differ"


def test_fast_kernels_differ():
    model = _model()
    with torch.no_grad():
        for k, v in lora.adapter_state(model).items():
            v.normal_(0, 0.3)
    prompts = _prompts(3, 32, 24)
    with ops.use_kernels("fast"):
        outs = RolloutEngine(model, max_batch_size=16, prefill_chunk=8).generate(prompts, SamplingParams(8, seed=1))
        assert count_diff(model, outs)[0] > 0, "negative control: library kernels should differ"
    outs = RolloutEngine(model, max_batch_size=16, prefill_chunk=8).generate(prompts, SamplingParams(8, seed=1))
    assert count_diff(model, outs)[0] == 0


def test_the_product_follows_its_schedule_and_a_fresh_adapter_changes_nothing():
    model = tiny_model(dtype="bfloat16")
    plain = tiny_model(dtype="bfloat16")
    lora.apply_lora(model, SPEC, seed=0)
    ids = torch.randint(0, 48, (2, 9), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([9, 6])
    with torch.no_grad():  # B = 0: the adapted model computes the base's bits
        assert torch.equal(model.token_logprobs(ids, lengths), plain.token_logprobs(ids, lengths))
    q = model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        q.lora_B.weight.normal_(0, 0.5)
        x = torch.randn(5, 64).to(torch.bfloat16)
        a, b, s = q.lora_A.weight, q.lora_B.weight, q.lora_scale
        t = (x.float() @ a.t() * s).to(torch.bfloat16).float()
        expect = ops.linear(x, q.weight) + (t @ b.t()).to(torch.bfloat16)
        got = q(x)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expect.float()).abs().max() <= 2 * 2.0 ** -8 * expect.float().abs().max()
    assert not torch.equal(model.token_logprobs(ids, lengths), plain.token_logprobs(ids, lengths))
    assert q.lora_scale == 2.0 and lora.LoraSpec(4, 8.0, rslora=True).scale == 4.0


def test_only_the_adapters_train_and_hold_optimizer_state():
    model = _model()
    base = {k: v.clone() for k, v in model.state_dict().items() if not lora.is_adapter(k)}
    before = _adapter_copy(model)
    learner = _learner(model)
    completions = RolloutEngine(model, max_batch_size=8).generate(_prompts(1, 8), SamplingParams(6, seed=1))
    _train_step(learner, completions)
    _train_step(learner, completions)
    held = {id(p) for g in learner.opt.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in model.named_parameters() if lora.is_adapter(n)}
    assert held == adapters and len(learner.opt.state) == len(adapters)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in base.items())
    assert any(not torch.equal(before[k], v) for k, v in lora.adapter_state(model).items())
    # a version's snapshot shares the frozen base and copies the adapters
    bundle = learner.weights(1)
    state = model.state_dict()
    assert all(bundle.policy[k].data_ptr() == state[k].data_ptr() for k in base)
    assert all(bundle.policy[k].data_ptr() != state[k].data_ptr() for k in before)
    # negative control: full fine-tuning moves the base
    full = tiny_model()
    _train_step(_learner(full), RolloutEngine(full, max_batch_size=8).generate(_prompts(1, 8), SamplingParams(6, seed=1)))
    assert any(not torch.equal(full.state_dict()[k], v) for k, v in tiny_model().state_dict().items())


def test_a_version_ships_the_adapters_alone_and_a_worker_swaps_them_in():
    model = _model()
    learner = _learner(model)
    first = learner.weights(0)
    static = first.static_names()
    assert static and not any(lora.is_adapter(k) for k in static) and set(static) | set(lora.adapter_state(model)) == set(first.policy)
    ring = SharedWeightRing(first.flat(), 2, static)
    assert ring.buffers[0][static[0]].data_ptr() == ring.buffers[1][static[0]].data_ptr()
    adapter_bytes = sum(v.numel() * v.element_size() for v in lora.adapter_state(model).values())
    assert ring.publish(0, first.flat()) == adapter_bytes
    kw = dict(model_config={k: v for k, v in model.config.to_dict().items() if k != "dtype"}, kernels="consistent",
              dtype="float32", max_batch_size=8, max_model_len=64, threads=1, lora=SPEC)
    worker = RolloutWorker(**kw)
    worker.load(0, ring.read(0))
    for version in (1, 2, 3):
        outs = worker.engine.generate(_prompts(version, 8), SamplingParams(6, seed=version))
        _train_step(learner, outs)
        assert ring.publish(version, learner.weights(version).flat()) == adapter_bytes
        worker.load(version, ring.read(version))
        outs = worker.engine.generate(_prompts(10 + version, 8), SamplingParams(6, seed=version))
        assert {c.weight_version for c in outs} == {version} and count_diff(model, outs) == (0, sum(len(c.token_ids) for c in outs))
    # negative control: without adapters nothing is static, and every tensor ships
    plain = tiny_model()
    full = _learner(plain).weights(0)
    assert full.static_names() == []
    assert SharedWeightRing(full.flat(), 2, full.static_names()).publish(0, full.flat()) == \
        sum(v.numel() * v.element_size() for v in plain.state_dict().values())
    # a bfloat16 engine keeps the adapters in float32
    assert all(v.dtype == torch.float32 for k, v in first.to(torch.bfloat16).policy.items() if lora.is_adapter(k))


def test_bad_adapters_and_settings_are_one_line():
    with pytest.raises(ValueError, match="lora.modules = 'qproj'"):
        lora.LoraSpec(4, modules="qproj")
    with pytest.raises(ValueError, match="lora.rank"):
        lora.LoraSpec(-1)
    model = _model()
    update = _adapter_copy(model)
    name = next(iter(update))
    with pytest.raises(ValueError, match="missing"):
        lora.load_weights(model, {name: update[name]})
    update[name] = torch.full_like(update[name], float("nan"))
    with pytest.raises(ValueError, match="non-finite"):
        lora.load_weights(model, update)
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.apply_lora(model, SPEC)


TINY = ["task.name=add1", "warmup.steps=2", "algo.prompts_per_update=2", "algo.group_size=2", "eval.n=4", "eval.every=0",
        "model.hidden_size=32", "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false",
        "metrics.decomposition_every=1", "checkpoint.every=0", "algo.updates=3", "algo.max_lag=1"]


def test_a_lora_run_trains_the_adapters_alone_with_zero_kernel_mismatch(tmp_path):
    from nemo_rz.runtime.trainer import Trainer

    run = tmp_path / "r"
    run.mkdir()
    cfg = config.load(None, TINY + [f"run_dir={run}", "lora.rank=4", "lora.modules=q_proj,v_proj,down_proj"])
    trainer = Trainer(cfg, run, log=lambda *_: None)
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if not lora.is_adapter(k)}
    summary = trainer.run()
    assert summary["updates"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["kernel_diff_tokens"] for r in records] == [0, 0, 0]
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in base.items())
    names = {k.rsplit(".", 3)[-3] for k in lora.adapter_state(trainer.model)}
    assert names == {"q_proj", "v_proj", "down_proj"}
    with pytest.raises(ValueError, match="lora.modules = 'q_proj,bogus'"):
        build.build(build.schema.typed(config.load(None, TINY + ["lora.rank=4", "lora.modules=q_proj,bogus"])))


def test_the_megatron_learner_refuses_lora_in_one_line():
    pytest.importorskip("megatron.core")
    from nemo_rz.runtime.megatron.learner import from_config

    cfg = build.schema.typed(config.load(None, TINY + ["lora.rank=4"]))
    with pytest.raises(ValueError, match="LoRA runs on the built-in learner only"):
        from_config(cfg.megatron, cfg.algo, 0, _model(), None)


def test_the_memory_bound_counts_gradients_and_adam_for_the_adapter_alone():
    """schema.memory_need with lora.rank > 0: the base held by the learner, once for the workers and by each worker,
    without gradients or Adam's moments; the float32 adapter with both, in every kept version and worker. The
    numbers by hand for a small shape; full fine-tuning's bound (the control) is the old one."""
    from omegaconf import OmegaConf

    from nemo_rz import schema

    shape = schema.Shape(hidden=8, inter=16, layers=2, heads=2, kv=1, head_dim=4, vocab=10, positions=64, tied=True)
    plain = OmegaConf.to_container(config.load(None, ["algo.max_lag=1", "runtime.rollout_workers=1"]))
    attn = 8 * 8 * 2 + 8 * 4 * 2  # q, o: 8 x 8; k, v: 8 x 4
    params = 10 * 8 + 2 * (attn + 3 * 8 * 16)
    full = schema.memory_need(plain, shape)["weights and optimizer state"]
    assert full == 4 * params * (4 + 2 + 1)
    plain["lora"].update(rank=2, modules="q_proj,down_proj")
    adapter = 2 * 2 * ((8 + 8) + (16 + 8))  # layers x rank x (in + out) of q_proj and down_proj
    assert schema.lora_params(plain["lora"], shape) == adapter == 160
    assert schema.memory_need(plain, shape)["weights and optimizer state"] == 4 * params * (2 + 1) + 4 * adapter * (4 + 2 + 1)
    plain["lora"]["modules"] = "attention"
    assert schema.lora_params(plain["lora"], shape) == 2 * 2 * (16 + 12 + 12 + 16)
    plain["lora"]["modules"] = "mlp"
    assert schema.lora_params(plain["lora"], dataclasses.replace(shape, experts=4, topk=2, moe_inter=8)) == 0
    plain["lora"]["rank"] = 0
    assert schema.memory_need(plain, shape)["weights and optimizer state"] == full


def test_a_quantized_base_with_a_float32_adapter_has_zero_mismatch():
    """mxfp8 on every base linear (row-local activation scales), LoRA on top: the adapter stays float32 and outside
    the recipe (its term is adapter_product of the raw A and B, bit for bit), and after adapter updates the built-in
    engine records the learner's logprobs at batch 1 and 16. Negative controls: fast kernels differ; an adapter
    run through the recipe (A and B quantized like the base) gives another term."""
    from nemo_rz.quant.apply import apply_precision
    from nemo_rz.quant.linear import QuantizedLinear, quantize_weight

    def model(seed):
        return lora.apply_lora(apply_precision(tiny_model(0, dtype="bfloat16"), "mxfp8"), SPEC, seed=seed)

    learner_model = model(0)
    learner = _learner(learner_model)
    engine_model = model(1)
    engine_model.load_state_dict(learner_model.state_dict())
    engine = RolloutEngine(engine_model, max_batch_size=16)
    for version in (1, 2):
        completions = engine.generate(_prompts(version, 4, 6), SamplingParams(3, seed=version))
        _train_step(learner, completions)
        engine.update_weights(_adapter_copy(learner_model), version)
    q = learner_model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and not isinstance(q.lora_A, QuantizedLinear)
    assert all(v.dtype == torch.float32 for v in lora.adapter_state(learner_model).values())
    assert q.lora_B.weight.abs().sum() > 0
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        term = q(x) - QuantizedLinear.forward(q, x)
        assert torch.equal(q(x), QuantizedLinear.forward(q, x) + lora.adapter_product(x, q.lora_A.weight, q.lora_B.weight, q.lora_scale))
        a_q = quantize_weight(q.lora_A.weight, "mxfp8").dequantize()
        quantized_term = lora.adapter_product(x, a_q, q.lora_B.weight, q.lora_scale)
    assert not torch.equal(term, quantized_term)  # control: a quantized adapter would be seen
    for n in (1, 16):  # the engine at version 2, batch 1 and 16
        outs = engine.generate(_prompts(50 + n, n, 6), SamplingParams(3, seed=n)) if n == 16 else \
            RolloutEngine(engine_model, max_batch_size=1).generate(_prompts(51, 1, 6), SamplingParams(3, seed=1))
        assert {c.weight_version for c in outs} == ({2} if n == 16 else {0})
        diff, total = count_diff(learner_model, outs)
        assert total > 0 and diff == 0, f"batch {n}: {diff} of {total} tokens differ"
    with ops.use_kernels("fast"):  # the engine on library kernels against the consistent learner
        outs = RolloutEngine(engine_model, max_batch_size=16, prefill_chunk=4).generate(_prompts(9, 16, 10), SamplingParams(3, seed=4))
    assert count_diff(learner_model, outs)[0] > 0, "negative control: library kernels should differ"
