"""The Megatron-core learner: the built-in Decoder's logprobs bit for bit at TP=1 and at TP=2 (consistent
kernels; Megatron's own layers are the negative control), for every dense family (Gemma 3, Mistral, Qwen2's
window mix, gpt-oss's attention) and every precision recipe, weights converted both ways, DP=2 gradients equal
to DP=1's over the same shares, and the train CLI over 2 processes (gloo): training with zero kernel mismatch,
and a rank that dies stopping the job with one line and an intact checkpoint."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import tiny_model  # noqa: E402
from megatron_ranks import FAMILIES, PP2_FAMILIES, QUANT_MODEL, TP2_FAMILIES, VOCAB, batch, family_model, learner, rl_batch, with_values  # noqa: E402
from megatron_world import launched, policy, world_of_one  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models import Decoder  # noqa: E402
from nemo_rz.parallel.tensor import tree_sum  # noqa: E402
from nemo_rz.quant.apply import apply_precision  # noqa: E402
from nemo_rz.quant.linear import RECIPES, Precision  # noqa: E402
from nemo_rz.runtime import checkpoint  # noqa: E402
from nemo_rz.runtime.megatron import convert, distributed, launch  # noqa: E402
from nemo_rz.runtime.megatron import precision as megatron_precision  # noqa: E402
from nemo_rz.runtime.megatron.model import MegatronPolicy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.name=add1", "warmup.steps=40", "warmup.lr=0.003", "algo.prompts_per_update=4", "algo.group_size=4",
        "eval.n=16", "eval.every=2", "model.hidden_size=32", "model.intermediate_size=64", "progress=false",
        "metrics.tensorboard=false", "metrics.decomposition_every=1", "checkpoint.every=1",
        "runtime.learner=megatron", "megatron.tp=2"]


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with world_of_one():
        yield


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What 2 ranks computed (tests/megatron_ranks.py): TP=2 logprobs, a DP=2 update."""
    return launched("megatron_ranks.py", tmp_path_factory.mktemp("ranks") / "out.pt")


@pytest.mark.parametrize("family", [dict(), dict(tie_word_embeddings=True, qk_norm=False, attention_bias=True)],
                         ids=["qwen3", "llama-tied-qkv-bias"])
def test_tp1_logprobs_equal_the_builtin_decoder_bit_for_bit(family):
    model = tiny_model(0, vocab_size=VOCAB, **family)
    with torch.no_grad():  # biases start at zero: give them values that matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    ids, lengths = batch()
    want = model.token_logprobs(ids, lengths)
    got = policy(model, "consistent").token_logprobs(ids, lengths)
    assert torch.equal(got, want)
    with ops.use_kernels("fast"):  # negative control: Megatron's own layers
        fast = policy(model, "fast").token_logprobs(ids, lengths)
    assert not torch.equal(fast, want) and torch.allclose(fast, want, atol=1e-4)


def _same_weights(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_tp1_logprobs_and_weights_equal_the_builtin_decoder_bit_for_bit(name):
    model = family_model(name)
    ids, lengths = batch()
    want = model.token_logprobs(ids, lengths)
    p = policy(model, "consistent")
    assert torch.equal(p.token_logprobs(ids, lengths), want)
    assert _same_weights(p.state_dict(), model.state_dict())  # Hugging Face names, through the family's map
    # negative controls: each feature changes the logprobs (a Megatron model without it could not equal them) ...
    for off in FAMILIES[name][1]:
        plain = Decoder(dataclasses.replace(model.config, **off))
        plain.load_state_dict(model.state_dict(), strict=False)
        assert not torch.equal(plain.token_logprobs(ids, lengths), want), off
    # ... and Megatron's stock modules (the fast spec) refuse what they have no such feature for, in one line
    with ops.use_kernels("fast"), pytest.raises(ValueError, match=r"^model \w+ = .*fast kernels.*; use kernels=consistent"):
        MegatronPolicy(model.config)


def _quant_pair(recipe: str):
    """(the Decoder at `recipe`, a TP=1 Megatron policy with the same master weights, not yet quantized)."""
    model = with_values(tiny_model(0, vocab_size=VOCAB, **QUANT_MODEL))
    p = policy(model, "consistent")
    return apply_precision(model, recipe), p


@pytest.mark.parametrize("recipe", ["bf16", *RECIPES])
def test_precision_recipe_tp1_logprobs_equal_the_builtin_decoder_bit_for_bit(recipe):
    model, p = _quant_pair(recipe)
    ids, lengths = batch()
    want = model.token_logprobs(ids, lengths)
    plain = p.token_logprobs(ids, lengths)
    assert not torch.equal(plain, want)  # negative control: the recipe changes the logprobs
    got = megatron_precision.apply_precision(p, recipe).token_logprobs(ids, lengths)
    assert torch.equal(got, want)
    # the same quantized weights: layer 0's fused q/k/v values are the Decoder's q, k and v values, fused
    attn = model.model.layers[0].self_attn
    qkv = convert.fuse_qkv(*(getattr(attn, f"{n}_proj").quantized_weight()[1] for n in "qkv"), model.config)
    assert torch.equal(p.gpt.decoder.layers[0].self_attention.linear_qkv.product.values(), qkv)
    got.sum().backward()  # straight-through to the master weights
    assert all(torch.isfinite(q.grad).all() for q in p.gpt.parameters() if q.grad is not None)


def test_precision_quantizes_each_hugging_face_weight_whole():
    """Negative control: quantizing Megatron's fused q/k/v and gate/up weights as one tensor (one fp8_current
    scale for all of them) gives other weights than the Decoder's, and other logprobs."""
    model, p = _quant_pair("fp8_current")
    ids, lengths = batch()
    megatron_precision.apply_precision(p, "fp8_current")
    for m in p.gpt.modules():
        product = getattr(m, "product", None)
        if isinstance(product, megatron_precision.QuantizedProduct):
            product.join = "same"
    assert not torch.equal(p.token_logprobs(ids, lengths), model.token_logprobs(ids, lengths))


def test_precision_settings_the_megatron_learner_cannot_run_are_refused_in_one_line():
    model, p = _quant_pair("none")
    with pytest.raises(ValueError, match="^precision.activation_scaling=tensor: .*; use row$"):
        megatron_precision.apply_precision(p, Precision("fp8_current", activation_scaling="tensor"))
    with pytest.raises(ValueError, match="^precision.modules=experts: the model has no such layers"):
        megatron_precision.apply_precision(p, Precision("mxfp8", "experts"))
    with pytest.raises(ValueError, match="^precision.recipe=mxfp8: the Megatron learner's fast kernels .*; use kernels=consistent"):
        megatron_precision.apply_precision(policy(tiny_model(0, vocab_size=VOCAB), "fast"), "mxfp8")
    odd = tiny_model(0, vocab_size=VOCAB, intermediate_size=80)
    with pytest.raises(ValueError, match=r"^precision.recipe=mxfp8: model.layers.0.mlp.down_proj has 80 inputs"):
        megatron_precision.apply_precision(policy(odd, "consistent"), "mxfp8")


def test_weights_convert_both_ways_with_fused_qkv_and_gate_up():
    model = tiny_model(1, vocab_size=VOCAB, attention_bias=True, num_heads=4, num_kv_heads=2)
    hf = model.state_dict()
    meg = convert.to_megatron(hf, model.config)
    cfg = model.config
    # Megatron's layout: per kv group, that group's query heads, then its key, then its value
    qkv = meg["decoder.layers.0.self_attention.linear_qkv.weight"].view(cfg.num_kv_heads, -1, cfg.hidden_size)
    q = hf["model.layers.0.self_attn.q_proj.weight"].view(cfg.num_kv_heads, -1, cfg.hidden_size)
    assert torch.equal(qkv[1, : q.shape[1]], q[1])
    assert torch.equal(qkv[1, -cfg.head_dim:], hf["model.layers.0.self_attn.v_proj.weight"][cfg.head_dim:])
    back = convert.to_hf(meg, cfg)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    p = policy(model, "consistent")
    loaded = p.state_dict()
    assert loaded.keys() == hf.keys() and all(torch.equal(loaded[k], v) for k, v in hf.items())
    # TP shards: gate/up split as [gate_r; up_r] per rank; every shard reassembles to the whole
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    param = torch.nn.Parameter(torch.empty(0))
    param.tensor_model_parallel, param.partition_dim = True, 0
    parts = [convert.shard("x.linear_fc1.weight", fc1, param, r, 2) for r in range(2)]
    gate = hf["model.layers.0.mlp.gate_proj.weight"]
    assert torch.equal(parts[1][: gate.shape[0] // 2], gate[gate.shape[0] // 2:])
    assert torch.equal(convert.unshard("x.linear_fc1.weight", parts, param), fc1)
    with pytest.raises(ValueError, match="lack"):
        p.load_state_dict({k: v for k, v in hf.items() if "k_norm" not in k})


def test_a_tp_split_that_would_change_bits_is_refused(monkeypatch):
    from nemo_rz.runtime.megatron import layers

    layers.check_split_outputs({(64, 128), (64, 48)}, 2, torch.float32)
    real = ops.linear
    # negative control: a product whose bits depend on how many outputs it computes
    monkeypatch.setattr(layers.ops, "linear", lambda x, w, b=None: real(x, w) + 1e-3 * (w.shape[0] < 100))
    with pytest.raises(ValueError, match="tp = 2.*split by output rows"):
        layers.check_split_outputs({(64, 128)}, 2, torch.float32)


def test_a_tp_that_splits_a_query_group_is_refused_in_one_line():
    from nemo_rz.runtime.megatron import spec

    spec.transformer_config(tiny_model(0).config, 2)  # 2 kv heads: one per rank
    with pytest.raises(ValueError, match=r"^megatron.tp = 2 does not divide the model's num_kv_heads = 1; choose"):
        spec.transformer_config(tiny_model(0, num_kv_heads=1).config, 2)


def test_unsupported_models_are_refused_in_one_line(monkeypatch):
    from nemo_rz.runtime.megatron import spec

    # every DecoderConfig field is built now (mixtures of experts: test_megatron_moe.py): one taken out is refused
    monkeypatch.setattr(spec, "SUPPORTED", spec.SUPPORTED - {"num_experts"})
    with pytest.raises(ValueError, match="num_experts.*builtin"):
        MegatronPolicy(tiny_model(0, num_experts=4, moe_intermediate_size=32).config)


@pytest.mark.slow
def test_tp2_logprobs_equal_tp1_and_the_decoder_bit_for_bit(ranks):
    model = tiny_model(0, vocab_size=VOCAB)
    ids, lengths = batch()
    want = model.token_logprobs(ids, lengths)
    assert torch.equal(ranks["tp2_consistent"], want)
    assert all(torch.equal(ranks["tp2_consistent_weights"][k], v) for k, v in model.state_dict().items())
    # negative control: Megatron's row-parallel layers all-reduce partial sums, which round differently
    with ops.use_kernels("fast"):
        fast_tp1 = policy(model, "fast").token_logprobs(ids, lengths)
    assert not torch.equal(ranks["tp2_fast"], fast_tp1) and torch.allclose(ranks["tp2_fast"], fast_tp1, atol=1e-4)


@pytest.mark.parametrize("name", TP2_FAMILIES)
@pytest.mark.slow
def test_family_tp2_logprobs_and_weights_equal_the_builtin_decoder_bit_for_bit(ranks, name):
    model = family_model(name)
    ids, lengths = batch()
    assert torch.equal(ranks[f"tp2_{name}"], model.token_logprobs(ids, lengths))
    assert _same_weights(ranks[f"tp2_{name}_weights"], model.state_dict())


@pytest.mark.parametrize("name", PP2_FAMILIES)
@pytest.mark.slow
def test_family_pp2_logprobs_and_weights_equal_the_builtin_decoder_bit_for_bit(ranks, name):
    model = family_model(name)
    ids, lengths = batch()
    assert torch.equal(ranks[f"pp2_{name}"], model.token_logprobs(ids, lengths))
    assert _same_weights(ranks[f"pp2_{name}_weights"], model.state_dict())


@pytest.mark.slow
def test_precision_recipes_tp2_logprobs_equal_the_builtin_decoder_bit_for_bit(ranks):
    ids, lengths = batch()
    for recipe in ("bf16", *RECIPES):
        model, _ = _quant_pair(recipe)
        assert torch.equal(ranks[f"tp2_quant_{recipe}"], model.token_logprobs(ids, lengths)), recipe


def _update(grad_shares: int):
    lrn = learner(tiny_model(0, vocab_size=VOCAB), 1, grad_shares)
    lrn.rl_step(*rl_batch())
    return [p.grad.clone() for p in lrn.model.parameters()], lrn.state_dict_copy()


@pytest.mark.slow
def test_dp2_gradients_equal_dp1_over_the_same_shares(ranks):
    grads, weights = _update(grad_shares=2)
    assert all(torch.equal(a, b) for a, b in zip(ranks["dp2_grads"], grads))
    assert all(torch.equal(ranks["dp2_weights"][k], v) for k, v in weights.items())
    # negative control: the whole batch in one backward sums the rows in another order
    whole, _ = _update(grad_shares=1)
    assert not all(torch.equal(a, b) for a, b in zip(whole, grads))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(whole, grads))


def test_tree_sum_order_is_fixed_by_the_number_of_parts():
    a, b, c, d = (torch.tensor([v], dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0))
    assert torch.equal(tree_sum([a, b, c, d]), (a + b) + (c + d))
    assert torch.equal(tree_sum(torch.cat([a, b, c, d])), ((a + b) + (c + d))[0])
    assert not torch.equal(tree_sum([a, b, c, d]), ((a + b) + c) + d)  # a running sum rounds differently
    assert torch.equal(tree_sum([a, b, c]), (a + b) + c)


def _cli(run_dir, *overrides, **kw):
    cmd = [sys.executable, "-m", "nemo_rz.train", *TINY, f"run_dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


@pytest.mark.slow
def test_train_cli_tp2_trains_with_zero_kernel_mismatch(tmp_path):
    """With a precision recipe too: the Megatron learner's quantized linears are the rollout engine's."""
    proc = _cli(tmp_path / "run", "algo.updates=3", "precision.recipe=mxfp8")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["kernel_diff_tokens"] == 0 for r in rows)
    assert "held-out pass@1" in out


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError):
                pass
    return found


def _rank(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), None)


def _listening(pid: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets that `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append(cols[1].rsplit(":", 1)[0])
    return found


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_job_in_one_line_with_the_checkpoint_intact(tmp_path):
    run_dir = tmp_path / "run"
    proc = _cli(run_dir, "algo.updates=100000", start_new_session=True)
    try:
        deadline = time.time() + 240
        while checkpoint.latest(run_dir / "checkpoints") is None:
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
            time.sleep(0.5)
        ranks = {_rank(pid): pid for pid in _children(proc.pid)}
        # the ranks listen on the loopback address only (gloo's sockets; the rendezvous is a file)
        listening = [a for pid in ranks.values() for a in _listening(pid)]
        assert listening and set(listening) <= {"0100007F", "00000000000000000000000001000000"}, listening
        follower = ranks["1"]
        os.kill(follower, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == launch.EXIT_RANK_DIED
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "rank 1 of 2" in lines[0] and "SIGKILL" in lines[0] and f"resume={run_dir}" in lines[0]
    assert checkpoint.load_latest(run_dir / "checkpoints") is not None


def test_tp1_run_resumes_bit_exactly_from_its_checkpoint(tmp_path):
    """Weights, Adam moments and the rest of the state come back: 1 update + resume + 1 = 2 updates."""
    from safetensors.torch import load_file

    from nemo_rz import config
    from nemo_rz.runtime.trainer import Trainer

    over = [o for o in TINY if o != "megatron.tp=2"]
    def run(name, updates, resume=None):
        return Trainer(config.load(None, over + [f"run_dir={tmp_path / name}", f"algo.updates={updates}"]), tmp_path / name,
                       resume=resume, log=lambda *_: None).run()

    run("full", 2)
    run("part", 1)
    run("part", 2, resume=tmp_path / "part")
    full, part = (load_file(checkpoint.latest(tmp_path / n / "checkpoints") / "model.safetensors") for n in ("full", "part"))
    assert full.keys() == part.keys() and all(torch.equal(full[k], part[k]) for k in full)
    rows = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2] and all(r["kernel_diff_tokens"] == 0 for r in rows)


def test_the_converter_reads_the_family_map(monkeypatch):
    model = tiny_model(1, vocab_size=VOCAB)
    hf = model.state_dict()
    hf["model.layers.0.mlp.extra.weight"] = torch.zeros(2)  # a tensor the family's map does not name
    with pytest.raises(ValueError, match="does not name, first 'model.layers.0.mlp.extra.weight'"):
        convert.to_megatron(hf, model.config)
    moe = tiny_model(1, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    from nemo_rz.models.families import qwen3_moe

    monkeypatch.setattr(type(qwen3_moe.FAMILY), "megatron_tensors", lambda self: None)  # a family not built yet
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM models: the Megatron learner does not build this family yet"):
        convert.to_megatron(moe.state_dict(), moe.config)


def test_the_policy_puts_its_weights_and_inputs_on_the_placements_device(monkeypatch):
    """megatron.device=cuda: every parameter of the policy, and every input of token_logprobs, goes to the one
    device distributed.placement gave the rank (here the meta device stands in for cuda:LOCAL_RANK, which this
    machine lacks), and the logprobs come back on the caller's device. What still builds CPU tensors (the pipeline
    schedule, the context-parallel layout) is refused in one line. Negative control: the CPU placement keeps both
    on the CPU."""
    model = tiny_model(0, vocab_size=VOCAB)
    with ops.use_kernels("consistent"):
        on_cpu = MegatronPolicy(model.config)
        monkeypatch.setattr(distributed, "_PLACEMENT", distributed.Placement("gloo", torch.device("meta")))
        placed = MegatronPolicy(model.config)
    assert {p.device.type for p in on_cpu.parameters()} == {"cpu"}
    assert {p.device.type for p in placed.parameters()} == {"meta"} and placed.device == torch.device("meta")
    seen = []

    def spy(ids, lengths, temperature, mask):
        seen.extend(t.device.type for t in (ids, lengths, mask))
        return torch.zeros(ids.shape[0], ids.shape[1] - 1, device="cpu")

    monkeypatch.setattr(placed, "_token_logprobs", spy)
    ids, lengths = batch()
    lp = placed.token_logprobs(ids, lengths, mask=torch.ones(ids.shape[0], ids.shape[1] - 1))
    assert seen == ["meta"] * 3 and lp.device.type == "cpu"
    on = distributed.placement("cuda", env={"LOCAL_RANK": "0"}, cuda_devices=1)
    monkeypatch.setattr(distributed, "_PLACEMENT", on)
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"^megatron.device = cuda with megatron.cp = 2: .* or megatron.cp=1$"):
        MegatronPolicy(model.config)
