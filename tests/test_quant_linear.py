"""Quantized linear layers (nemo_rz.quant.linear, .apply; nemo_rz/kernels/quant_matmul.py): zero mismatch for every
recipe on the built-in engine, the same quantized weights on every side, quantized once per weight version,
straight-through gradients, and the Triton kernel's in-tile dequantization under TRITON_INTERPRET=1.

Negative controls: fast kernels (the same scenario differs), TE's per-tensor activation scaling (breaks batch
invariance in consistent mode), a learner at another precision, a stale weight cache, another K order.
"""
import functools
import os
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported (as tests/test_kernels.py)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import count_diff, skip_unless_dot_row_invariant, tiny_model  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402
from nemo_rz.quant import RECIPES, quantize  # noqa: E402
from nemo_rz.quant import linear as qlinear  # noqa: E402
from nemo_rz.quant.apply import apply_precision, forget_quantized_weights  # noqa: E402
from nemo_rz.quant.experts import QuantizedExperts  # noqa: E402
from nemo_rz.quant.linear import PRECISIONS, Precision, QuantizedLinear  # noqa: E402
from nemo_rz.quant.qtensor import QTensor  # noqa: E402

QUANTIZED = [p for p in PRECISIONS if p != "none"]


@functools.lru_cache(maxsize=None)
def _model(recipe: str, activation_scaling: str = "row"):
    return apply_precision(tiny_model(), Precision(recipe, activation_scaling=activation_scaling))


def _prompts(seed: int, n: int, max_len: int = 30) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g)
    return [torch.randint(0, 48, (int(k),), generator=g).tolist() for k in lengths]


REQUESTS = {1: 3, 7: 12, 64: 64}  # requests per engine batch size: batch 1 decodes them one after another


def _rollout(model, batch: int, n: int, seed: int = 0):
    engine = RolloutEngine(model, max_batch_size=batch, prefill_chunk=8)
    return engine.generate(_prompts(seed, n, 16), SamplingParams(max_new_tokens=8, seed=seed, stop_token_ids=(0, 1)))


# -- zero mismatch, every recipe ---------------------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("recipe", QUANTIZED)
def test_every_recipe_has_zero_mismatch_on_the_builtin_engine(recipe, batch):
    outs = _rollout(_model(recipe), batch, n=REQUESTS[batch], seed=batch)
    diff, total = count_diff(_model(recipe), outs)
    assert total > 0 and diff == 0


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_fast_kernels_differ_for_every_recipe(recipe):
    """Negative control: the same rollouts with library kernels (decode rows one at a time) differ."""
    with ops.use_kernels("fast"):
        outs = _rollout(_model(recipe), 1, n=4)
        assert count_diff(_model(recipe), outs)[0] > 0


def test_the_learner_must_run_the_same_recipe():
    """Negative control for what reaches the engine: a learner without quantization, or with another recipe,
    disagrees with the mxfp4 engine's logprobs."""
    outs = _rollout(_model("mxfp4"), 7, n=12)
    assert count_diff(_model("mxfp4"), outs)[0] == 0
    assert count_diff(tiny_model(), outs)[0] > 0
    assert count_diff(_model("nvfp4"), outs)[0] > 0


@pytest.mark.parametrize("recipe", ["fp8_current", "nvfp4"])
def test_per_tensor_activation_scaling_breaks_batch_invariance(recipe):
    """TE's exact per-tensor activation amax makes a token's bits depend on its batch mates: the engine's
    batches and the learner's [B, T] batch disagree in consistent mode, where the row-local form agrees."""
    model = _model(recipe, "tensor")
    outs = _rollout(model, 7, n=12)
    assert count_diff(model, outs)[0] > 0
    assert count_diff(_model(recipe), _rollout(_model(recipe), 7, n=12))[0] == 0


@pytest.mark.parametrize("scaling, same", [("row", True), ("tensor", False)])
def test_a_rows_output_does_not_depend_on_its_batch_only_when_row_local(scaling, same):
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.nn.Parameter(torch.randn(64, 128)), None, Precision("nvfp4", activation_scaling=scaling))
    x = torch.randn(9, 128)
    x[3] *= 50  # a loud batch mate moves a per-tensor amax
    with torch.no_grad():
        assert torch.equal(layer(x[:1]), layer(x)[:1]) == same


# -- mixture-of-experts models: the experts quantized too ---------------------------------------------------------
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)


@functools.lru_cache(maxsize=None)
def _moe(kind: str, recipe: str | None):
    return apply_precision(tiny_model(moe_kind=kind, **MOE), recipe)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("recipe", QUANTIZED)
def test_moe_models_have_zero_mismatch_at_every_recipe(kind, recipe):
    model = _moe(kind, recipe)
    assert type(model.model.layers[0].mlp.experts) is QuantizedExperts
    for batch in (1, 7, 64) if recipe == "mxfp4" else (7,):
        outs = _rollout(model, batch, n=REQUESTS[batch], seed=batch)
        diff, total = count_diff(model, outs)
        assert total > 0 and diff == 0


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_moe_negative_controls(kind):
    """Fast kernels, and a learner whose experts are not quantized, both disagree with the engine."""
    model = _moe(kind, "nvfp4")
    with ops.use_kernels("fast"):
        assert count_diff(model, _rollout(model, 1, n=4))[0] > 0
    outs = _rollout(model, 7, n=12)
    attention_only = apply_precision(tiny_model(moe_kind=kind, **MOE), {"recipe": "nvfp4", "modules": "attention"})
    assert count_diff(model, outs)[0] == 0 and count_diff(attention_only, outs)[0] > 0


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
def test_quantized_experts_compute_what_the_family_computes(kind, monkeypatch):
    """With the rounding made the identity, QuantizedExperts equals the family's own experts bit for bit,
    forward and gradients (so the substituted computation cannot drift from the model's)."""
    plain = tiny_model(moe_kind=kind, **MOE).train()
    quant = apply_precision(tiny_model(moe_kind=kind, **MOE).train(), {"recipe": "mxfp8", "modules": "experts"})
    monkeypatch.setattr(QuantizedExperts, "quantize", lambda self, x, role: x.detach().float())
    ids = torch.randint(0, 48, (3, 9), generator=torch.Generator().manual_seed(0))
    a, b = plain.token_logprobs(ids), quant.token_logprobs(ids)
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(plain.named_parameters(), quant.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_moe_master_weights_train_through_the_quantized_experts():
    model = apply_precision(tiny_model(moe_kind="qwen3", **MOE), "mxfp4")
    experts = model.model.layers[0].mlp.experts
    ids = torch.randint(0, 48, (4, 12), generator=torch.Generator().manual_seed(0))
    (-model.token_logprobs(ids).mean()).backward()
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0
    before = experts.quantized_weight("down_proj").clone()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    assert not torch.equal(experts.quantized_weight("down_proj"), before)  # a new version, quantized again


# -- one set of quantized weights --------------------------------------------------------------------------------
def _codes(model) -> dict:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantizedLinear):
            q, values = m.quantized_weight()
            out[name] = (q.data.view(torch.uint8), q.scale.view(torch.uint8), q.global_scale, values)
    return out


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_learner_and_engine_quantize_the_same_master_weights_to_the_same_bits(recipe):
    learner = apply_precision(tiny_model(seed=3).train(), Precision(recipe))
    engine_side = tiny_model(seed=9)  # other weights, replaced by the learner's as a weight update does
    engine_side.load_state_dict(learner.state_dict())
    engine_side = apply_precision(engine_side.eval().requires_grad_(False), Precision(recipe))
    a, b = _codes(learner), _codes(engine_side)
    assert a.keys() == b.keys() and len(a) == 2 * 7
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert (x is None and y is None) or torch.equal(x, y), name
    # Negative control: the same weights shipped through bfloat16 (runtime.rollout_dtype) quantize differently.
    rounded = tiny_model(seed=9)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in learner.state_dict().items()})
    c = _codes(apply_precision(rounded, Precision(recipe)))
    assert any(not torch.equal(a[n][3], c[n][3]) for n in a)


def test_state_dict_names_and_lm_head_are_unchanged():
    plain, quant = tiny_model(tie_word_embeddings=False), apply_precision(tiny_model(tie_word_embeddings=False), "mxfp8")
    assert list(plain.state_dict()) == list(quant.state_dict())
    assert type(quant.lm_head).__name__ == "Linear"
    attn_only = apply_precision(tiny_model(), {"recipe": "mxfp8", "modules": "attention"})
    kinds = {n.split(".")[-2] for n, m in attn_only.named_modules() if isinstance(m, QuantizedLinear)}
    assert kinds == {"self_attn"}


def test_weight_is_quantized_once_per_version(monkeypatch):
    calls = []
    real = qlinear.quantize_weight
    monkeypatch.setattr(qlinear, "quantize_weight", lambda w, r: calls.append(1) or real(w, r))
    model = apply_precision(tiny_model(), Precision("fp8_block"))
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 64)
    with torch.no_grad():
        first = layer(x)
        layer(x)
    assert len(calls) == 1
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    layer(x).sum().backward()
    opt.step()  # an in-place update moves the version counter
    with torch.no_grad():
        assert not torch.equal(layer(x), first)
    assert len(calls) == 2  # the training forward reused it; the step made a new version
    # Writes through .data bypass the counter (as vLLM's loaders write): stale until forgotten.
    with torch.no_grad():
        before = layer(x)
        layer.weight.data.mul_(2)
        assert torch.equal(layer(x), before), "negative control: the cache cannot see a .data write"
        forget_quantized_weights(model)
        assert not torch.equal(layer(x), before)


@pytest.mark.parametrize("recipe", QUANTIZED)
def test_gradient_is_straight_through_to_the_master_weight(recipe):
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(48, 64))
    b = torch.nn.Parameter(torch.randn(48))
    layer = QuantizedLinear(w, b, Precision(recipe))
    x = torch.randn(2, 5, 64, requires_grad=True)
    g = torch.randn(2, 5, 48)
    (layer(x) * g).sum().backward()
    # Reference: autograd through F.linear on the quantized operands as leaves.
    x_q = qlinear.dequantized(x, recipe, "activation").requires_grad_()
    w_q = layer.quantized_weight()[1].clone().requires_grad_()
    y = F.linear(x_q, w_q, b.detach())
    (y * g).sum().backward()
    assert torch.allclose(w.grad, w_q.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad, x_q.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(b.grad, g.sum((0, 1)), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer(x).detach(), ops.linear(x_q.detach(), w_q.detach(), b.detach()))


def test_training_updates_the_master_weights_and_the_quantized_forward_follows():
    model = apply_precision(tiny_model(), Precision("mxfp4"))
    ids = torch.randint(0, 48, (4, 12), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = model.token_logprobs(ids).detach()
    for _ in range(3):
        opt.zero_grad()
        (-model.token_logprobs(ids).mean()).backward()
        opt.step()
    after = model.token_logprobs(ids).detach()
    assert after.mean() > before.mean()
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # master weights stay high precision


# -- the runtime: a rollout worker applies the learner's precision ------------------------------------------------
def test_rollout_worker_runs_the_learners_recipe():
    from nemo_rz.runtime.jobs import Job, decode_completions
    from nemo_rz.runtime.worker import RolloutWorker

    learner = _model("nvfp4")
    config = {k: v for k, v in learner.config.to_dict().items() if k != "dtype"}
    worker = RolloutWorker(config, "consistent", "float32", 8, 64, 1, precision={"recipe": "nvfp4"})
    worker.load(0, learner.state_dict())
    wire, _, _ = worker.run(Job(0, 0, _prompts(5, 8), 10, 1.0, seed=5, stop_token_ids=()))
    outs = decode_completions(wire)
    assert count_diff(learner, outs)[0] == 0
    assert count_diff(tiny_model(), outs)[0] > 0  # negative control: an unquantized learner


def test_the_config_offers_exactly_the_precisions():
    from nemo_rz import schema

    assert schema.PRECISION_RECIPES == PRECISIONS
    assert schema.SCHEMA["precision.modules"]._choices() == qlinear.MODULE_SETS
    assert schema.SCHEMA["precision.activation_scaling"]._choices() == qlinear.ACTIVATION_SCALING
    assert "fp8_delayed" in schema.SCHEMA["precision.recipe"].expected()


# -- refusals ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, words", [
    ({"recipe": "fp8_delayed"}, "amax history"),
    ({"recipe": "fp4"}, "precision.recipe='fp4': use one of"),
    ({"recipe": "mxfp8", "activation_scaling": "block"}, "precision.activation_scaling"),
    ({"recipe": "mxfp8", "modules": "experts"}, "no such layers"),
])
def test_bad_precision_is_one_clear_line(spec, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")) as e:
        apply_precision(tiny_model(), spec)
    assert "\n" not in str(e.value)


def test_a_width_the_block_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="not a multiple of the recipe's block of 32"):
        apply_precision(tiny_model(hidden_size=48, num_heads=3, num_kv_heads=1), "mxfp4")


# -- quantized checkpoints ---------------------------------------------------------------------------------------
def test_fp8_block_scaled_checkpoint_decodes_exactly(tmp_path):
    from safetensors.torch import load_file, save_file

    from nemo_rz.quant.checkpoints import dequantized
    from nemo_rz.quant.qtensor import expand

    torch.manual_seed(0)
    w = torch.randn(200, 300) * 0.02
    scale_inv = torch.nn.functional.pad(w.abs(), (0, 84, 0, 56)).reshape(2, 128, 3, 128).amax((1, 3)) / 448
    codes = (w / expand(scale_inv, (128, 128), w.shape)).to(torch.float8_e4m3fn)  # as the releases write them
    save_file({"q.weight": codes, "q.weight_scale_inv": scale_inv, "norm.weight": torch.ones(3)}, tmp_path / "m.safetensors")
    config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    out = dequantized(load_file(tmp_path / "m.safetensors"), config)
    assert sorted(out) == ["norm.weight", "q.weight"]
    assert torch.equal(out["q.weight"], codes.float() * expand(scale_inv, (128, 128), w.shape))
    assert float((out["q.weight"] - w).norm() / w.norm()) < 0.05
    with pytest.raises(ValueError, match="q.weight_scale_inv: shape"):
        dequantized({"q.weight": codes, "q.weight_scale_inv": scale_inv[:1]}, config)
    with pytest.raises(ValueError, match="only 128x128"):
        dequantized({}, {"quant_method": "fp8", "weight_block_size": [64, 64]})


def test_gpt_oss_mxfp4_checkpoint_decodes_and_requantizes_to_the_same_values():
    from nemo_rz.quant.checkpoints import dequantized

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 64, 3, 16), dtype=torch.uint8, generator=g)  # every code, both nibbles
    scales = torch.randint(100, 140, (2, 64, 3), dtype=torch.uint8, generator=g)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    out = dequantized({name + "_blocks": blocks, name + "_scales": scales}, {"quant_method": "mxfp4"})
    values = out[name]  # transformers' [E, in, out] layout
    assert values.shape == (2, 96, 64)
    codes = torch.stack((blocks & 0xF, blocks >> 4), -1).reshape(2, 64, 96).long()
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    expected = grid[codes] * torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
    assert torch.equal(values.transpose(1, 2), expected)
    # The mxfp4 recipe gives the release's values back; another recipe does not (negative control).
    for e in range(2):
        assert torch.equal(quantize(expected[e], "mxfp4", "weight").dequantize(), expected[e])
    assert not torch.equal(quantize(expected[0], "nvfp4", "weight").dequantize(), expected[0])
    with pytest.raises(ValueError, match="_scales are missing"):
        dequantized({name + "_blocks": blocks}, {"quant_method": "mxfp4"})


# -- the Triton kernel (interpreter on CPU) ----------------------------------------------------------------------
def _kernel():
    pytest.importorskip("triton")
    from nemo_rz.kernels.quant_matmul import quant_linear

    return quant_linear


def _raw(codes: torch.Tensor, block_cols: int) -> QTensor:
    """A QTensor over given codes with multipliers 1 (an exact decode check)."""
    rows, cols = codes.shape[0], codes.shape[1] * (2 if codes.dtype == torch.uint8 else 1)
    return QTensor(codes, torch.ones(rows, cols // block_cols), None, (1, block_cols), "fp8_current", torch.Size([rows, cols]))


def test_kernel_decodes_every_e4m3_and_e2m1_code_exactly():
    quant_linear = _kernel()
    e4m3 = torch.arange(256, dtype=torch.uint8)
    e4m3[(e4m3 & 0x7F) == 0x7F] = 0  # the two NaN codes never come out of a quantizer
    w8 = _raw(e4m3.view(torch.float8_e4m3fn).reshape(8, 32), 32)
    e2m1 = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # every pair of codes, both nibbles
    w4 = _raw(e2m1, 32)
    eye = quantize(torch.eye(64), "mxfp8", "activation")  # exactly the identity (power-of-two scales)
    assert torch.equal(quant_linear(quantize(torch.eye(32), "mxfp8", "activation"), w8), w8.dequantize().T)
    assert torch.equal(quant_linear(eye, w4), w4.dequantize().T)
    assert torch.equal(quant_linear(quantize(torch.eye(64), "mxfp4", "activation"), w4), w4.dequantize().T)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kernel_dequantizes_in_the_tile_like_the_torch_side(recipe):
    quant_linear = _kernel()
    torch.manual_seed(0)
    w = torch.randn(80, 256) * 0.05
    w[3, :64] *= 1e-38  # fp32-subnormal blocks
    q = quantize(w, recipe, "weight")
    eye = quantize(torch.eye(256), "mxfp8", "activation")
    assert torch.equal(quant_linear(eye, q), q.dequantize().T)  # bit for bit, every block
    x = torch.randn(37, 256)
    qx = quantize(x, recipe, "activation")
    ref = qx.dequantize().double() @ q.dequantize().double().T
    y = quant_linear(qx, q, torch.ones(80))
    assert torch.allclose(y.double(), ref + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_kernel_rows_do_not_depend_on_the_batch(recipe):
    quant_linear = _kernel()
    from nemo_rz.kernels.quant_matmul import tile_config

    bm, bn, bk = tile_config(96, 256)
    skip_unless_dot_row_invariant(SimpleNamespace(block_m=bm, block_n=bn, block_k=bk))
    torch.manual_seed(2)
    x, q = torch.randn(70, 256), quantize(torch.randn(96, 256), recipe, "weight")
    full = quant_linear(quantize(x, recipe, "activation"), q)
    for lo, hi in ((0, 1), (5, 12), (64, 70)):
        assert torch.equal(quant_linear(quantize(x[lo:hi], recipe, "activation"), q), full[lo:hi])


def test_kernel_k_order_matters_so_the_invariance_check_can_fail():
    """Negative control: another K chunk (another summation order) changes bits, so the fixed tile shape is
    what keeps rows invariant."""
    quant_linear = _kernel()
    torch.manual_seed(3)
    qx = quantize(torch.randn(16, 512), "fp8_current", "activation")  # fp32 scales: inexact sums
    q = quantize(torch.randn(64, 512), "fp8_current", "weight")
    assert not torch.equal(quant_linear(qx, q), quant_linear(qx, q, block_k=16))
