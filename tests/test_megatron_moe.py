"""Mixtures of experts on the Megatron learner (runtime/megatron/moe.py): Qwen3-MoE and gpt-oss-MLP logprobs equal
to the built-in Decoder's bit for bit at EP=1 and at EP=2 (2 ranks, dp=2, one launch), Megatron's stock MoE layer
as the negative control, the routing record, weights in Hugging Face names both ways, deterministic gradients;
megatron.ep=2 with megatron.dp left at its default raises dp to 2 (an explicit dp=1 is refused in one line)."""
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_moe_ranks import batch, learner, moe_model  # noqa: E402
from megatron_ranks import rl_batch  # noqa: E402
from megatron_world import launched, policy, world_of_one  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models.moe import recorded_routing  # noqa: E402
from nemo_rz.runtime.megatron import convert  # noqa: E402
from nemo_rz.runtime.megatron.layout import Layout  # noqa: E402
from nemo_rz.runtime.megatron.model import MegatronPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT_OSS_MLP = dict(moe_kind="gpt_oss", num_experts_per_tok=3, qk_norm=False, moe_layers=[1])  # layer 0 dense
# the whole gpt-oss shape: its attention too (sinks, YaRN, o_proj and q/k/v biases, float32 RMSNorm, a window layer)
GPT_OSS = dict(moe_kind="gpt_oss", num_experts_per_tok=2, qk_norm=False, attention_sinks=True, norm="rms_f32",
               o_proj_bias=True, attention_bias=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
               rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64), head_dim=16)


def moe_tiny():
    """conf/moe_tiny.yaml's model, as the train CLI builds it (fresh weights, the task's vocabulary)."""
    from nemo_rz import config, schema
    from nemo_rz.runtime.build import build_model, build_task

    cfg = schema.typed(config.load("moe_tiny"))
    torch.manual_seed(0)
    model = build_model(cfg.model, build_task(cfg.task, cfg.model).tokenizer)
    with torch.no_grad():  # weights that route unevenly and sinks that matter
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "sinks" in name:
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with world_of_one():
        yield


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What 2 ranks at dp=2, ep=2 computed (tests/megatron_moe_ranks.py)."""
    return launched("megatron_moe_ranks.py", tmp_path_factory.mktemp("moe_ranks") / "out.pt")


def _same_weights(got: dict, model) -> bool:
    want = model.state_dict()
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("family", [{}, GPT_OSS_MLP, GPT_OSS, "moe_tiny"], ids=["qwen3-moe", "gpt-oss-mlp", "gpt-oss", "moe_tiny"])
def test_ep1_logprobs_and_routing_equal_the_builtin_decoder_bit_for_bit(family):
    model = moe_tiny() if family == "moe_tiny" else moe_model(0, **family)
    ids, lengths = batch()
    ids = ids % model.config.vocab_size
    with recorded_routing(model) as want_routing:
        want = model.token_logprobs(ids)
    p = policy(model, "consistent")
    with recorded_routing(p) as routing:
        got = p.token_logprobs(ids)
    assert torch.equal(got, want)
    assert torch.equal(p.token_logprobs(ids, lengths), model.token_logprobs(ids, lengths))
    assert len(routing) == len(want_routing) == (1 if family == GPT_OSS_MLP else 2)
    for mine, theirs in zip(routing.values(), want_routing.values()):
        assert torch.equal(mine[0], theirs[0])  # (row, position) order, route_topk's order
    assert _same_weights(p.state_dict(), model)


def test_fast_kernels_are_megatrons_stock_moe_layer_and_differ():
    model = moe_model(0)
    ids, lengths = batch()
    want = model.token_logprobs(ids, lengths)
    with ops.use_kernels("fast"):
        fast = policy(model, "fast")
        got = fast.token_logprobs(ids, lengths)
        from megatron.core.transformer.moe.experts import SequentialMLP

        assert isinstance(fast.gpt.decoder.layers[0].mlp.experts, SequentialMLP)
        assert _same_weights(fast.state_dict(), model)  # per-expert linear_fc1 / fc2 <-> the stacked experts
    # negative control: Megatron weights the activations before the down projection and adds in scatter order
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=1e-4)
    with pytest.raises(ValueError, match="moe_kind = 'gpt_oss'.*kernels=consistent"):
        with ops.use_kernels("fast"):
            MegatronPolicy(moe_model(0, **GPT_OSS_MLP).config)


def test_the_combine_order_is_what_makes_the_bits(monkeypatch):
    """negative control of the consistent layer itself: the k outputs added in slot (arrival) order, not expert order."""
    from nemo_rz.runtime.megatron import moe

    model = moe_model(0, **GPT_OSS_MLP)  # k=3: the order of the additions matters
    ids, _ = batch()
    want = model.token_logprobs(ids)
    p = policy(model, "consistent")
    monkeypatch.setattr(moe.ops, "moe_combine", lambda y, w, e: (y.view(*w.shape, -1) * w.unsqueeze(-1)).sum(1))
    got = p.token_logprobs(ids)
    assert not torch.equal(got, want) and torch.allclose(got, want, atol=1e-4)


def test_expert_weights_convert_both_ways():
    model = moe_model(1, moe_layers=[0])  # layer 1 dense: its gate/up rule, layer 0's experts
    hf, cfg = model.state_dict(), model.config
    meg = convert.to_megatron(hf, cfg)
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(meg["decoder.layers.0.mlp.experts.gate_up_proj"], gate_up)
    assert torch.equal(meg["decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"], gate_up[2])
    assert torch.equal(meg["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in meg and "decoder.layers.1.mlp.router.weight" not in meg
    stock = {k: v for k, v in meg.items() if "experts.gate_up_proj" not in k and "experts.down_proj" not in k}
    back = convert.to_hf(stock, cfg)  # Megatron's per-expert tensors stacked back
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    del stock["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"]
    with pytest.raises(ValueError, match="needs all 4 experts' tensors, got experts \\[0, 1, 2\\]"):
        convert.to_hf(stock, cfg)


def test_moe_refusals_are_one_line(monkeypatch):
    from nemo_rz.runtime.megatron import moe

    with pytest.raises(ValueError, match="megatron.ep = 2: .*raise megatron.dp"):
        Layout(ep=2)  # ep splits experts over the dp x cp ranks: it adds no process
    cfg = moe_model(0).config
    moe.check_layout(cfg, 2, 1, fast=False)
    for (ep, tp, fast), what in (((3, 1, False), "megatron.ep = 3 does not divide model num_experts = 4"),
                                 ((1, 2, False), "megatron.tp = 2 with a mixture of experts.*use megatron.tp=1"),
                                 ((2, 1, True), "megatron.ep = 2: the fast kernels.*kernels=consistent")):
        with pytest.raises(ValueError, match=what):
            moe.check_layout(cfg, ep, tp, fast)
    # the layer's own check (what the spec checks when Megatron's groups exist): a stand-in 2-rank group
    monkeypatch.setattr(moe.dist, "get_world_size", {"ep": 1, "tp": 2}.get)
    with pytest.raises(ValueError, match="megatron.tp = 2 with a mixture of experts"):
        moe.MoE(config=None, submodules=None, pg_collection=type("Groups", (), {"ep": "ep", "tp": "tp"})(), model_config=cfg)


def test_ep_raises_a_default_dp_to_what_it_needs_and_refuses_an_explicit_one(capsys):
    from nemo_rz import config, schema
    from nemo_rz.runtime.megatron.launch import world_size

    cfg = config.load("moe_tiny", ["runtime.learner=megatron", "megatron.ep=2", "megatron.pp=2"])
    assert cfg.megatron.dp == 2 and world_size(cfg) == 4 and Layout.from_section(schema.typed(cfg).megatron).dp == 2
    assert capsys.readouterr().err.strip() == ("note: megatron.ep = 2: experts are split over data-parallel ranks, so "
                                               "megatron.dp is 2")
    assert config.load("moe_tiny", ["runtime.learner=megatron", "megatron.ep=2", "megatron.cp=2"]).megatron.dp == 1
    assert config.load(None, []).megatron.dp == 1 and not capsys.readouterr().err  # no ep: no note
    # negative control: dp given is kept, so ep=2 over dp=1 is refused when the layout is built
    kept = config.load("moe_tiny", ["runtime.learner=megatron", "megatron.ep=2", "megatron.dp=1"])
    assert kept.megatron.dp == 1 and not capsys.readouterr().err
    with pytest.raises(ValueError, match="megatron.ep = 2: .*raise megatron.dp"):
        Layout.from_section(schema.typed(kept).megatron)


def _update(model) -> list[torch.Tensor]:
    lrn = learner(model, Layout())
    lrn.rl_step(*rl_batch())
    return [p.grad.clone() for p in lrn.model.parameters()]


def test_ep1_gradients_are_deterministic_run_to_run():
    with ops.use_kernels("consistent"):
        a, b = _update(moe_model(0)), _update(moe_model(0))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert any(g.dim() == 3 and g.abs().sum() > 0 for g in a)  # the experts learn
    # negative control: another start gives other gradients (the comparison can fail)
    c = _update(moe_model(1))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("kind", ["qwen3", "gpt_oss"])
@pytest.mark.slow
def test_ep2_logprobs_equal_ep1_and_the_decoder_bit_for_bit(ranks, kind):
    model = moe_model(0, **({} if kind == "qwen3" else GPT_OSS_MLP))
    ids, lengths = batch()
    want = model.token_logprobs(ids, lengths)
    assert torch.equal(ranks[f"{kind}_ep2"], want)
    assert torch.equal(policy(model, "consistent").token_logprobs(ids, lengths), want)  # EP=1
    assert _same_weights(ranks[f"{kind}_ep2_weights"], model)
    assert ranks[f"{kind}_local_experts"] == ([2, 2] if kind == "qwen3" else [None, 2])  # 4 experts over 2 ranks
    # the routing record: both ranks' rows (gathered over dp), as the Decoder routes them
    with recorded_routing(model) as routing:
        model.token_logprobs(ids)
    for mine, theirs in zip(ranks[f"{kind}_ep2_routing"].values(), routing.values(), strict=True):
        assert len(mine) == 1 and torch.equal(mine[0], theirs[0])


@pytest.mark.slow
def test_ep2_updates_are_deterministic_and_match_ep1_closely(ranks):
    a, b = ranks["updates_a"], ranks["updates_b"]
    assert a["routing_diff"] == [0, 1]  # decompose at dp=2: the rollout's routing, then one token's flipped (control)
    assert all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    assert a["weights"].keys() == b["weights"].keys() and all(torch.equal(a["weights"][k], v) for k, v in b["weights"].items())
    # the same two updates at EP=1 over the same 2 shares: the expert products sum other row groups, so close only
    lrn = learner(moe_model(0), Layout(grad_shares=2))
    for _ in range(2):
        lrn.rl_step(*rl_batch())
    ep1 = [p.grad for p in lrn.model.parameters()]
    assert all(torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a["grads"], ep1))
