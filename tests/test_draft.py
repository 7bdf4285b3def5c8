"""The draft head: features from hooks, training-time test equal to inference, co-training detached from the
policy, weights shipped with each version, saved drafts checked against their target."""
import pytest
import torch
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.algorithms import group_advantages
from nemo_rz.algorithms.draft import DraftTrainer, summary
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.generation.speculative import Speculator
from nemo_rz.models.draft import DraftHead, aux_features, default_aux_layers, frequent_tokens, load_draft, save_draft
from nemo_rz.runtime.learner import Learner
from nemo_rz.runtime.weights import WeightsBundle

MODEL = tiny_model(seed=2, num_layers=3)


def _features(model, layers, ids, final=False):
    with aux_features(model, layers, final=final) as found, torch.no_grad():
        model.token_logprobs(ids)
    return found[0]


def test_aux_features_are_the_chosen_layers_outputs_and_the_hooks_go_away():
    ids = torch.tensor([[1, 5, 7, 2, 9, 4]])
    layers = (0, 2)
    got = _features(MODEL, layers, ids)
    outs = []
    with torch.no_grad():  # the same forward, layer by layer, with the hooks' view: each layer's output
        handles = [MODEL.model.layers[i].register_forward_hook(lambda m, a, o: outs.append(o)) for i in range(3)]
        MODEL.token_logprobs(ids)
        for h in handles:
            h.remove()
    assert torch.equal(got, torch.cat([outs[0], outs[2]], -1))
    aux, final = _features(MODEL, layers, ids, final=True)  # and the final norm's output, the logits' input
    assert torch.equal(aux, got) and torch.equal(MODEL.logits(final).view(1, 6, -1), MODEL(ids))
    assert not any(layer._forward_hooks for layer in MODEL.model.layers) and not MODEL.model.norm._forward_hooks
    assert default_aux_layers(2) == (0, 1) and default_aux_layers(28) == (1, 13, 24)


def test_training_time_test_computes_what_inference_computes():
    """Step s of the branch rooted at P, run all at once in training, equals the engine's path: a catch-up over
    positions 0..P through the draft's KV cache, then s - 1 chained steps fed by the draft's own hidden states."""
    torch.manual_seed(0)
    draft = DraftHead(MODEL.config, (0, 1, 2), num_layers=2)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    aux = _features(MODEL, draft.aux_layers, ids)
    with torch.no_grad():
        branch = dict(draft.branches(MODEL, aux, ids, 3))
        for root in (0, 4, 8):
            cache = draft.new_cache(1, 32)
            n = root + 1
            g = draft.step(MODEL, draft.fc(aux[:n]), ids[0, 1 : n + 1], torch.arange(n), torch.zeros(n, dtype=torch.long), cache)[-1:]
            assert torch.allclose(g[0], branch[1][0, root], atol=1e-5, rtol=1e-4)
            for s in (2, 3):
                pos = root + s - 1
                wrong = draft.step(MODEL, g, ids[0, pos + 1 : pos + 2], torch.tensor([pos + 1]), torch.zeros(1, dtype=torch.long),
                                   draft.new_cache(1, 32))
                g = draft.step(MODEL, g, ids[0, pos + 1 : pos + 2], torch.tensor([pos]), torch.zeros(1, dtype=torch.long), cache)
                assert torch.allclose(g[0], branch[s][0, root], atol=1e-5, rtol=1e-4)
                assert not torch.allclose(wrong[0], branch[s][0, root], atol=1e-3)  # control: without its context


def test_training_time_test_is_the_inference_bits():
    """The training-time test's attention is ops.attention's consistent core (parallel.context's branch attention
    on one rank) and its layers the draft's own Blocks, so step s of the branch rooted at P is the engine's bits,
    for roots on both sides of a key block's end and branches spilling into the next block. Negative control:
    the engine's path with the library's kernels (fast mode)."""
    torch.manual_seed(0)
    draft = DraftHead(MODEL.config, (0, 1, 2), num_layers=2)
    ids = torch.randint(0, MODEL.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(3))
    aux = _features(MODEL, draft.aux_layers, ids)

    def engine(root):
        cache, n = draft.new_cache(1, 64), root + 1
        g = draft.step(MODEL, draft.fc(aux[:n]), ids[0, 1 : n + 1], torch.arange(n), torch.zeros(n, dtype=torch.long), cache)[-1:]
        out = [g[0]]
        for pos in (root + 1, root + 2):
            g = draft.step(MODEL, g, ids[0, pos + 1 : pos + 2], torch.tensor([pos]), torch.zeros(1, dtype=torch.long), cache)
            out.append(g[0])
        return out

    with torch.no_grad():
        branch = dict(draft.branches(MODEL, aux, ids, 3))
        for root in (0, 5, 29, 30, 31, 32, 44):
            assert all(torch.equal(got, branch[s][0, root]) for s, got in enumerate(engine(root), 1)), root
        with ops.use_kernels("fast"):
            fast = engine(30)
    assert not all(torch.equal(got, branch[s][0, 30]) for s, got in enumerate(fast, 1))


def _batch(seed=0):
    outs = RolloutEngine(MODEL).generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 2, SamplingParams(10, seed=seed))
    return pack(outs), group_advantages(torch.tensor([1.0, 0, 1, 0, 0, 1]), 2)


def test_co_training_leaves_the_policy_update_unchanged_and_trains_the_draft():
    batch, adv = _batch()
    runs = []
    for with_draft in (False, True):
        model = tiny_model(seed=2, num_layers=3).train()
        learner = Learner(model, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})
        if with_draft:
            torch.manual_seed(0)
            learner.draft = DraftTrainer(DraftHead(model.config), "cotrain", 1e-3, 1.0, steps=2, k=3)
            before = {k: v.clone() for k, v in learner.draft.draft.state_dict().items()}
        m, lp = learner.rl_step(batch, adv)
        runs.append((learner.weights(1), lp, m))
    (plain, lp0, m0), (drafted, lp1, m1) = runs
    plain, target, draft = plain.policy, drafted.policy, drafted.parts["draft"]
    assert target.keys() == plain.keys() and all(torch.equal(plain[k], target[k]) for k in plain)
    assert torch.equal(lp0, lp1) and m0["grad_norm"] == m1["grad_norm"]
    assert any(not torch.equal(before[k], draft[k]) for k in before)  # the draft stepped
    assert {"draft_loss", "draft_accept_rate", "draft_accepted_len", "draft_tokens_per_pass"} <= m1.keys()
    assert "draft_loss" not in m0


def test_draft_weights_ship_with_the_policy_version():
    model = tiny_model(seed=2, num_layers=3)
    learner = Learner(model, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    torch.manual_seed(1)
    learner.draft = DraftTrainer(DraftHead(model.config), "cotrain", 1e-3, 1.0, steps=2, k=3)
    learner.rl_step(*_batch())
    torch.manual_seed(2)
    engine = RolloutEngine(tiny_model(seed=9, num_layers=3), speculator=Speculator(DraftHead(model.config), 3))
    bundle = learner.weights(1)
    back = WeightsBundle.from_flat(bundle.flat(), 1)  # the flat form (shared memory, checkpoints) reads back
    assert set(bundle.parts) == set(back.parts) == {"draft"} and back.policy.keys() == bundle.policy.keys()
    assert all(torch.equal(v, back.parts["draft"][k]) for k, v in bundle.parts["draft"].items())
    engine.update_weights(bundle.policy, 1, bundle.parts)
    shipped = engine.speculator.draft.state_dict()
    assert all(torch.equal(v, shipped[k]) for k, v in learner.draft.draft.state_dict().items())
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in model.state_dict().items())
    # The optimizer state of both travels in checkpoints; a restore brings the draft's back.
    state = learner.optimizer_state()
    assert "draft" in state and state["draft"]["optimizer"]["state"]
    learner.draft.opt = torch.optim.Adam(learner.draft.draft.parameters(), lr=1e-3)
    learner.load_optimizer_state(state, 1e-3)
    assert learner.draft.opt.state_dict()["state"].keys() == state["draft"]["optimizer"]["state"].keys()


@pytest.mark.parametrize("distill", [False, True])
def test_co_training_raises_the_acceptance_estimate(distill):
    """On sampled tokens, and distilled from the target's distributions (the learner's path)."""
    batch, _ = _batch(seed=3)
    torch.manual_seed(0)
    trainer = DraftTrainer(DraftHead(MODEL.config), "cotrain", 5e-3, 1.0, steps=2, k=3)
    aux, final = _features(MODEL, trainer.draft.aux_layers, batch.input_ids, final=True)
    final = final if distill else None
    first = trainer.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs, final=final)
    for _ in range(8):
        last = trainer.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs, final=final)
    assert last["draft_loss"] < first["draft_loss"] and last["draft_accept_rate"] > first["draft_accept_rate"]
    frozen = DraftTrainer(trainer.draft, "frozen", 5e-3, 1.0, steps=2, k=3)
    before = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    frozen.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs)
    assert all(torch.equal(v, trainer.draft.state_dict()[k]) for k, v in before.items())  # frozen: numbers only
    assert summary({"draft_loss_1": 2.0, "draft_accept_1": 0.5}, k=2) == dict(
        draft_loss=2.0, draft_accept_rate=0.375, draft_accepted_len=0.75, draft_tokens_per_pass=1.75)


def test_distillation_is_the_cross_entropy_against_the_target_distribution():
    """Step 1's distilled loss at temperature 0.7 by hand: root t's draft distribution over the draft vocabulary
    against the target's at position t + 1, both at that temperature."""
    batch, _ = _batch(seed=4)
    torch.manual_seed(0)
    draft = DraftHead(MODEL.config, vocab_size=12)
    draft.choose_vocab(batch.input_ids)
    aux, final = _features(MODEL, draft.aux_layers, batch.input_ids, final=True)
    loss, _ = draft.training_loss(MODEL, aux, batch.input_ids, batch.mask, 1, 0.7, final=final)
    b, length = batch.input_ids.shape
    with torch.no_grad():
        (_, x), = draft.branches(MODEL, aux, batch.input_ids, 1)
        rows = torch.nn.functional.pad(batch.mask[:, 1:].bool(), (0, 2)).reshape(-1).nonzero().squeeze(1)
        logq = torch.log_softmax(draft.logits(MODEL, x.reshape(b * length, -1)[rows]).float() / 0.7, -1)
        logp = torch.log_softmax(MODEL.logits(final[rows + 1])[:, draft.vocab].float() / 0.7, -1)
    assert torch.allclose(loss, -(logp.exp() * logq).sum(-1).mean(), rtol=1e-5)
    assert float(loss.detach()) > float(-(logp.exp() * logp).sum(-1).mean())  # cross-entropy >= the target's entropy


def test_a_reduced_vocabulary_is_the_most_frequent_tokens_of_the_first_batch():
    ids = torch.tensor([5, 5, 5, 9, 9, 2, 7, 7, 7, 7])
    assert frequent_tokens(ids, 48, 3).tolist() == [5, 7, 9]
    assert frequent_tokens(ids, 48, 6).tolist() == [0, 1, 2, 5, 7, 9]  # 2, then the lowest unseen ids (0, 1)
    assert frequent_tokens(torch.tensor([3, 4]), 48, 1).tolist() == [3]  # a tie: the lower id
    batch, _ = _batch(seed=5)
    torch.manual_seed(0)
    trainer = DraftTrainer(DraftHead(MODEL.config, vocab_size=6), "cotrain", 5e-3, 1.0, steps=2, k=3)
    draft = trainer.draft
    assert draft.vocab.tolist() == list(range(6)) and trainer.vocab_pending
    aux, final = _features(MODEL, draft.aux_layers, batch.input_ids, final=True)
    trainer.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs, final=final)
    completions = batch.input_ids[:, 1:][batch.mask.bool()]
    assert draft.vocab.tolist() == frequent_tokens(completions, 48, 6).tolist() != list(range(6))
    assert not trainer.state_dict()["vocab_pending"]
    ids = draft.draft_ids(torch.arange(48))
    assert [int(i) for i in ids[draft.vocab]] == list(range(6)) and int((ids >= 0).sum()) == 6
    assert draft.logits(MODEL, torch.randn(2, MODEL.config.hidden_size)).shape == (2, 6)
    # The vocabulary travels with the draft's weights and its saved file.
    other = DraftHead(MODEL.config, vocab_size=6)
    other.load_state_dict(draft.state_dict())
    assert torch.equal(other.vocab, draft.vocab)
    with pytest.raises(ValueError, match=r"draft.vocab_size = 0: must be >= 1"):
        DraftHead(MODEL.config, vocab_size=0)


def test_saved_drafts_load_and_misfits_are_one_line_errors(tmp_path):
    draft = DraftHead(MODEL.config, (1, 2), num_layers=2, vocab_size=10)
    draft.choose_vocab(torch.tensor([40, 41, 41]))
    save_draft(draft, tmp_path / "d.pt")
    back = load_draft(tmp_path / "d.pt", MODEL)
    assert back.aux_layers == (1, 2) and all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    assert back.vocab.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 40, 41]
    with pytest.raises(ValueError, match=r"the draft's vocab_size 48 does not match the target's 40"):
        load_draft(tmp_path / "d.pt", tiny_model(num_layers=3, vocab_size=40))
    with pytest.raises(ValueError, match=r"layer 2 is outside the target's layers 0..1"):
        load_draft(tmp_path / "d.pt", tiny_model(num_layers=2))
    with pytest.raises(ValueError, match="no such file"):
        load_draft(tmp_path / "missing.pt", MODEL)
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a saved draft"):
        load_draft(tmp_path / "other.pt", MODEL)
    with pytest.raises(ValueError, match=r"draft.steps = 0: must be >= 1"):
        draft.training_loss(MODEL, torch.zeros(4, 128), torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 3), steps=0)
    with pytest.raises(ValueError, match=r"draft.aux_layers = \[0, 3\]: layer 3 is outside"):
        DraftHead(MODEL.config, (0, 3))


def test_a_co_trained_run_logs_the_engine_counts_and_resumes_bit_exactly(tmp_path):
    """draft.mode=cotrain through the trainer with a reduced draft vocabulary: metrics.jsonl carries the rollout
    engine's acceptance beside the learner's estimate, and a resumed run (draft weights, vocabulary, optimizer)
    ends with the same weights and metrics as an uninterrupted one."""
    from safetensors.torch import load_file
    from test_runtime import TIMING, TINY, _metrics, _run

    from nemo_rz import config
    from nemo_rz.runtime import checkpoint
    from nemo_rz.runtime.trainer import Trainer

    draft = ["draft.mode=cotrain", "draft.vocab_size=8", "draft.k=3", "algo.max_lag=1"]
    _run(tmp_path, "full", "algo.updates=4", *draft)
    rows = _metrics(tmp_path / "full")
    assert all({"draft_loss", "draft_accept_rate", "spec_accept_rate", "spec_tokens_per_pass"} <= r.keys() for r in rows)
    assert all(0 <= r["spec_accept_rate"] <= 1 and 1 <= r["spec_tokens_per_pass"] <= 4 for r in rows)
    assert all(0 < r["spec_draft_time_share"] < 1 for r in rows)
    assert all(r["kernel_diff_tokens"] == 0 for r in rows)  # speculative rollouts record the learner's bits
    _run(tmp_path, "part", "algo.updates=3", *draft)  # stops where the full run evaluates and checkpoints
    part = tmp_path / "part"
    cfg = config.load(None, TINY + [f"run_dir={part}", "algo.updates=4", *draft])
    Trainer(cfg, part, resume=part, log=lambda *_: None).run()
    full_w = load_file(checkpoint.latest(tmp_path / "full" / "checkpoints") / "model.safetensors")
    part_w = load_file(checkpoint.latest(part / "checkpoints") / "model.safetensors")
    assert "draft.vocab" in full_w and full_w["draft.vocab"].tolist() != list(range(8))  # chosen from the first batch
    assert full_w.keys() == part_w.keys() and all(torch.equal(full_w[k], part_w[k]) for k in full_w)
    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    assert strip(_metrics(part)) == strip(rows)
