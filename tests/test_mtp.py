"""DeepSeek-V3's multi-token-prediction layers as the speculative draft (draft.kind=mtp, nemo_rz.models.mtp).

- Checkpoint: a random tiny DeepSeek-V3 checkpoint (transformers' DeepseekV3Config) with num_nextn_predict_layers=1
  carries its MTP layer as model.layers.{L}.*; load_hf keeps the decoder, load_mtp the layer; save_hf_with_mtp
  writes both back in the hub's layout and they reload bit for bit.
- Parity: the MTP's logits match the formula read independently (plain torch for enorm / hnorm / eh_proj /
  shared_head, transformers' own DeepseekV3DecoderLayer for the layer, on the loaded tensors) within 1e-4 in
  float32; negative control: without the position-0 embedding mask the bound fails.
- Speculative rollouts with an MTP draft: greedy tokens and logprobs equal plain decoding's, sampled logprobs equal
  the learner's bit for bit; fast kernels differ (negative control).
- Co-training through the learner's auxiliary-loss hook: the policy's update is unchanged, the MTP layer steps,
  the shared head does not; the training-time test's first step is the engine's bits.
- A checkpoint without MTP layers is a one-line refusal, through the config too.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import count_diff
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_deepseek import randomized

from nemo_rz import ops
from nemo_rz.algorithms import group_advantages
from nemo_rz.algorithms.draft import DraftTrainer
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.generation.speculative import Speculator
from nemo_rz.models import Decoder, DecoderConfig, load_hf
from nemo_rz.models.hf_config import ModelFileError
from nemo_rz.models.mtp import MTPHead, load_mtp, save_hf_with_mtp
from nemo_rz.runtime.learner import Learner

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

TOL = 1e-4
LAYERS = 2
BASE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=32,
                                 mscale=1.0, mscale_all_dim=0.7))



@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(a checkpoint of LAYERS layers plus one MTP layer, transformers' model of LAYERS + 1 layers whose last layer is
    that MTP layer's decoder layer). The MTP's own tensors are random, its head unlike the model's."""
    root = tmp_path_factory.mktemp("mtp")
    full = transformers.AutoModelForCausalLM.from_config(
        transformers.DeepseekV3Config(**BASE, num_hidden_layers=LAYERS + 1), attn_implementation="eager",
        dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    randomized(full, g)
    full.save_pretrained(root / "full")
    tensors = load_file(root / "full" / "model.safetensors")
    h, v, m = BASE["hidden_size"], BASE["vocab_size"], f"model.layers.{LAYERS}"
    tensors.update({f"{m}.enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                    f"{m}.hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                    f"{m}.eh_proj.weight": 0.15 * torch.randn(h, 2 * h, generator=g),
                    f"{m}.shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
                    f"{m}.shared_head.head.weight": 0.15 * torch.randn(v, h, generator=g),
                    f"{m}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    (root / "mtp").mkdir()
    save_file(tensors, root / "mtp" / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((root / "full" / "config.json").read_text())
    d.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (root / "mtp" / "config.json").write_text(json.dumps(d))
    return root / "mtp", full, tensors


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference(full, tensors, ids, h_final, mask_position_0=True):
    """The MTP's logits at positions 0..T-2 from the formula: transformers' decoder layer on eh_proj(cat(enorm(embed
    of the next token), hnorm(the target's final hidden state))), then shared_head.norm and shared_head.head."""
    m, eps = f"model.layers.{LAYERS}", full.config.rms_norm_eps
    b, length = ids.shape
    emb = tensors["model.embed_tokens.weight"][ids[:, 1:]]
    if mask_position_0:
        emb[:, 0] = 0
    x = torch.cat([_rms(emb, tensors[f"{m}.enorm.weight"], eps), _rms(h_final[:, :-1], tensors[f"{m}.hnorm.weight"], eps)], -1)
    x = x @ tensors[f"{m}.eh_proj.weight"].T
    pos = torch.arange(length - 1)[None].expand(b, -1)
    causal = torch.full((length - 1, length - 1), float("-inf")).triu(1)[None, None].expand(b, 1, -1, -1)
    y = full.model.layers[LAYERS](x, attention_mask=causal, position_ids=pos,
                                  position_embeddings=full.model.rotary_emb(x, pos))
    y = y[0] if isinstance(y, tuple) else y
    return _rms(y, tensors[f"{m}.shared_head.norm.weight"], eps) @ tensors[f"{m}.shared_head.head.weight"].T


def _mtp_logits(model, head, ids):
    b, length = ids.shape
    with head.tap(model) as found, torch.no_grad():
        model(ids)
        feat = found[0].view(b, length, -1)[:, :-1].reshape(b * (length - 1), -1)
        cache = head.new_cache(b, length)
        pos = torch.arange(length - 1).repeat(b)
        g = head.step(model, head.fc(feat), ids[:, 1:].reshape(-1), pos, torch.arange(b).repeat_interleave(length - 1),
                      cache)
        return head.logits(model, g).view(b, length - 1, -1), found[0].view(b, length, -1)


def test_the_mtp_layer_loads_matches_the_formula_and_round_trips(ckpt, tmp_path, monkeypatch):
    path, full, tensors = ckpt
    model = load_hf(path)
    assert model.config.num_layers == LAYERS  # the decoder as transformers builds it; the MTP layer apart
    head = load_mtp(path, model)
    assert len(head.layers) == 1 and head.config.is_moe(0)
    assert torch.equal(head.layers[0].eh_proj.weight, tensors[f"model.layers.{LAYERS}.eh_proj.weight"])
    assert not head.layers[0].shared_head.head.weight.requires_grad
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(1))
    logits, h_final = _mtp_logits(model, head, ids)
    with torch.no_grad():
        assert (h_final - full.model(ids[:, :]).last_hidden_state).abs().max() > 0  # (full has one layer more)
        h_ref = transformers.AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")(ids).last_hidden_state
        assert (h_final - h_ref).abs().max() < TOL
        expected = _reference(full, tensors, ids, h_final)
    assert (logits - expected).abs().max() < TOL
    # negative control: the formula without its position-0 embedding mask is out of the bound
    with torch.no_grad():
        assert (logits - _reference(full, tensors, ids, h_final, mask_position_0=False)).abs().max() > 10 * TOL
    # saved back in the hub's layout, it reloads bit for bit
    save_hf_with_mtp(model, head, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["num_nextn_predict_layers"] == 1 and saved["num_hidden_layers"] == LAYERS
    with safe_open(tmp_path / "saved" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert {f"model.layers.{LAYERS}.mlp.experts.7.down_proj.weight", f"model.layers.{LAYERS}.embed_tokens.weight",
            f"model.layers.{LAYERS}.shared_head.head.weight"} <= names
    again = load_mtp(tmp_path / "saved", load_hf(tmp_path / "saved"))
    mine, theirs = head.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_checkpoints_without_mtp_layers_are_refused_in_one_line(ckpt, tmp_path):
    from nemo_rz.config import load
    from nemo_rz.runtime.build import build_mtp
    from nemo_rz.schema import typed

    path, full, tensors = ckpt
    model = load_hf(path)
    plain = tmp_path / "plain"
    plain.mkdir()
    d = json.loads((path / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**d, "num_nextn_predict_layers": 0}))
    save_file({k: v for k, v in tensors.items() if not k.startswith(f"model.layers.{LAYERS}.")}, plain / "model.safetensors")
    with pytest.raises(ModelFileError, match="no multi-token-prediction layers") as e:
        load_mtp(plain, model)
    assert "\n" not in str(e.value) and "draft.kind=eagle" in str(e.value)
    draft = typed(load("deepseek_tiny", ["draft.mode=cotrain", "draft.kind=mtp", f"model.hf_path={plain}"])).draft
    with pytest.raises(ValueError, match="no multi-token-prediction layers"):
        build_mtp(draft, "cotrain", model, str(plain), "builtin")
    frozen = build_mtp(draft, "frozen", model, str(path), "builtin")  # the control: a checkpoint with the layer
    assert torch.equal(frozen.layers[0].hnorm.weight, tensors[f"model.layers.{LAYERS}.hnorm.weight"])
    with pytest.raises(ValueError, match="the megatron learner does not tap"):
        build_mtp(draft, "cotrain", model, str(path), "megatron")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.endswith(f"{LAYERS}.eh_proj.weight")}, broken / "model.safetensors")
    with pytest.raises(ModelFileError, match=rf"MTP layers \(model.layers.{LAYERS}..{LAYERS}\).*missing.*eh_proj") as e:
        load_mtp(broken, model)
    assert "\n" not in str(e.value)


# -- speculative rollouts and co-training on a fresh tiny DeepSeek-V3 model -----------------------------------
@functools.cache
def _model() -> Decoder:
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=48, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_layers=2,
                        num_heads=4, num_kv_heads=1, head_dim=16, qk_norm=False, attention_kind="mla", q_lora_rank=24,
                        kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True, num_experts=8,
                        num_experts_per_tok=2, moe_kind="deepseek", n_group=2, topk_group=1, n_shared_experts=1,
                        routed_scaling_factor=2.5, moe_layers=[1])
    model = Decoder(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return model.eval()


PROMPTS = [torch.randint(0, 48, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 9, 17, 5, 22, 12)]


def _batch(model, seed=0):
    outs = RolloutEngine(model).generate(PROMPTS[:4], SamplingParams(6, seed=seed))
    return pack(outs), group_advantages(torch.tensor([1.0, 0, 0, 1]), 2)


@pytest.fixture(scope="module")
def trained():
    """An MTP draft co-trained a few steps on the model's own completions (some proposals kept, some refused)."""
    model = _model()
    torch.manual_seed(0)
    head = MTPHead(model.config)
    trainer = DraftTrainer(head, "cotrain", 1e-2, 1.0, steps=2, k=3)
    batch = pack(RolloutEngine(model).generate(PROMPTS, SamplingParams(10, temperature=0.0)))
    with head.tap(model, final=True) as found, torch.no_grad():
        model.token_logprobs(batch.input_ids)
    for _ in range(3):
        trainer.step(model, *found[0][:1], batch.input_ids, batch.mask, 1.0, None, "draft", found[0][1])
    return model, head


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_rollouts_with_the_mtp_draft_record_the_targets_logprobs(trained, temperature):
    model, head = trained
    params = SamplingParams(10, temperature=temperature, seed=3)
    engine = RolloutEngine(model, max_batch_size=3, prefill_chunk=8, speculator=Speculator(head, 3))
    spec = engine.generate(PROMPTS, params)
    assert 0 < engine.stats["spec_accepted"] < engine.stats["spec_proposed"]  # both paths of the verifier ran
    assert count_diff(model, spec, temperature or 1.0) == (0, sum(len(c.token_ids) for c in spec))
    if temperature == 0:
        plain = RolloutEngine(model, max_batch_size=3).generate(PROMPTS, params)
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
        assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(spec, plain))
        return
    with ops.use_kernels("fast"):  # negative control: the library kernels' rollout differs from the learner's bits
        fast = RolloutEngine(model, max_batch_size=3, prefill_chunk=8, speculator=Speculator(head, 3)).generate(PROMPTS, params)
    assert count_diff(model, fast, temperature)[0] > 0


def test_training_time_test_step_one_is_the_engine_bits(trained):
    model, head = trained
    ids = torch.tensor([PROMPTS[4]])
    with head.tap(model, final=True) as found, torch.no_grad():
        model(ids)
        branch = dict(head.branches(model, found[0][0], ids, 2))
    logits, _ = _mtp_logits(model, head, ids)
    with torch.no_grad():
        assert torch.equal(head.logits(model, branch[1][0, :-1]), logits[0])


def test_co_training_through_the_aux_loss_hook_leaves_the_policy_update_unchanged():
    model0 = _model()
    batch, adv = _batch(model0)
    runs = []
    for with_mtp in (False, True):
        model = Decoder(model0.config)
        model.load_state_dict(model0.state_dict())
        model.train()
        learner = Learner(model, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})
        if with_mtp:
            torch.manual_seed(0)
            learner.draft = DraftTrainer(MTPHead(model.config), "cotrain", 1e-3, 1.0, steps=2, k=3)
            before = {k: v.clone() for k, v in learner.draft.draft.state_dict().items()}
        m, lp = learner.rl_step(batch, adv)
        runs.append((learner.weights(1), lp, m))
    (plain, lp0, m0), (drafted, lp1, m1) = runs
    target, draft = drafted.policy, drafted.parts["draft"]
    assert all(torch.equal(plain.policy[k], target[k]) for k in plain.policy) and torch.equal(lp0, lp1)
    assert m0["grad_norm"] == m1["grad_norm"] and "draft_loss" in m1 and "draft_loss" not in m0
    assert not torch.equal(before["layers.0.eh_proj.weight"], draft["layers.0.eh_proj.weight"])  # the MTP stepped
    assert torch.equal(before["layers.0.shared_head.head.weight"], draft["layers.0.shared_head.head.weight"])  # frozen


def test_a_runs_mtp_draft_exports_into_the_checkpoint_and_loads_back(ckpt, tmp_path):
    """draft.kind=mtp: the export writes the run's trained MTP layer as the checkpoint's own model.layers.{L}
    (num_nextn_predict_layers), which load_mtp reads back against the exported policy bit for bit. Negative control:
    the base checkpoint's MTP layer (what an export that copied the start checkpoint would hold) differs."""
    from test_export import make_run

    from nemo_rz.runtime import checkpoint
    from nemo_rz.tools.export import DRAFT_FILE, export

    path = ckpt[0]
    model = make_run(tmp_path / "run", f"model.hf_path={path}", "model.tokenizer=char", "draft.mode=cotrain",
                     "draft.kind=mtp")
    head = load_mtp(path, model)
    with torch.no_grad():  # the draft moved by training
        g = torch.Generator().manual_seed(5)
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    flat = {**model.state_dict(), **{f"draft.{k}": v for k, v in head.state_dict().items()}}
    checkpoint.save(tmp_path / "run" / "checkpoints", flat, {}, {}, {"version": 4}, keep=2)
    out = export(tmp_path / "run", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not (out / DRAFT_FILE).exists()  # the MTP layer lives in the checkpoint itself
    target = load_hf(out)
    again = load_mtp(out, target)
    mine, theirs = head.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    base = load_mtp(path, model).state_dict()
    assert not torch.equal(base["layers.0.eh_proj.weight"], theirs["layers.0.eh_proj.weight"])
