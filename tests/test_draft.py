"""The draft head: features from hooks, training-time test equal to inference, co-training detached from the
policy, weights shipped with each version, saved drafts checked against their target."""
import pytest
import torch

from conftest import tiny_model
from nemo_rz.algorithms import group_advantages
from nemo_rz.algorithms.draft import DraftTrainer, summary
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.generation.speculative import Speculator
from nemo_rz.models.draft import DraftHead, aux_features, default_aux_layers, load_draft, save_draft, split_state
from nemo_rz.runtime.learner import Learner

MODEL = tiny_model(seed=2, num_layers=3)


def _features(model, layers, ids):
    with aux_features(model, layers) as found, torch.no_grad():
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
    assert not any(layer._forward_hooks for layer in MODEL.model.layers)
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
        runs.append((learner.state_dict_copy(), lp, m))
    (plain, lp0, m0), (drafted, lp1, m1) = runs
    target, draft = split_state(drafted)
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
    engine.update_weights(learner.state_dict_copy(), version=1)
    shipped = engine.speculator.draft.state_dict()
    assert all(torch.equal(v, shipped[k]) for k, v in learner.draft.draft.state_dict().items())
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in model.state_dict().items())
    # The optimizer state of both travels in checkpoints; a restore brings the draft's back.
    state = learner.optimizer_state()
    assert "draft" in state and state["draft"]["state"]
    learner.draft.opt = torch.optim.Adam(learner.draft.draft.parameters(), lr=1e-3)
    learner.load_optimizer_state(state, 1e-3)
    assert learner.draft.opt.state_dict()["state"].keys() == state["draft"]["state"].keys()


def test_co_training_raises_the_acceptance_estimate():
    batch, _ = _batch(seed=3)
    torch.manual_seed(0)
    trainer = DraftTrainer(DraftHead(MODEL.config), "cotrain", 5e-3, 1.0, steps=2, k=3)
    aux = _features(MODEL, trainer.draft.aux_layers, batch.input_ids)
    first = trainer.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs)
    for _ in range(8):
        last = trainer.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs)
    assert last["draft_loss"] < first["draft_loss"] and last["draft_accept_rate"] > first["draft_accept_rate"]
    frozen = DraftTrainer(trainer.draft, "frozen", 5e-3, 1.0, steps=2, k=3)
    before = {k: v.clone() for k, v in trainer.draft.state_dict().items()}
    frozen.step(MODEL, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs)
    assert all(torch.equal(v, trainer.draft.state_dict()[k]) for k, v in before.items())  # frozen: numbers only
    assert summary({"draft_loss_1": 2.0, "draft_accept_1": 0.5}, k=2) == dict(
        draft_loss=2.0, draft_accept_rate=0.375, draft_accepted_len=0.75, draft_tokens_per_pass=1.75)


def test_saved_drafts_load_and_misfits_are_one_line_errors(tmp_path):
    draft = DraftHead(MODEL.config, (1, 2), num_layers=2)
    save_draft(draft, tmp_path / "d.pt")
    back = load_draft(tmp_path / "d.pt", MODEL)
    assert back.aux_layers == (1, 2) and all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
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
