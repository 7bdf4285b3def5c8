"""The learner's auxiliary-loss hook: a registered loss learns from the RL forward's own features (no second pass
of the policy), trains only its own parameters, and keeps its optimizer state under its name."""
import contextlib

import pytest
import torch
from conftest import tiny_model

from nemo_rz.algorithms import aux_loss
from nemo_rz.generation.packing import pack
from nemo_rz.generation.sampling import Completion
from nemo_rz.runtime.learner import Learner


class Probe:
    """A linear probe on the last layer's output, predicting the next token: the smallest real auxiliary loss."""

    name = "probe"

    def __init__(self, hidden: int, vocab: int, second_pass: bool = False):
        self.head = torch.nn.Linear(hidden, vocab)
        self.opt = torch.optim.Adam(self.head.parameters(), lr=0.1)
        self.second_pass, self.seen = second_pass, []

    @contextlib.contextmanager
    def tap(self, model):
        found = []
        handle = model.model.layers[-1].register_forward_hook(lambda _m, _a, out: found.append(out.detach()))
        try:
            yield found
        finally:
            handle.remove()

    def learn(self, model, tapped, batch, temperature, what):
        if self.second_pass:  # what the hook exists to avoid: the negative control of the pass count
            model.token_logprobs(batch.input_ids, batch.lengths, temperature)
        self.seen.append(len(tapped))
        x = aux_loss.padded(tapped[0], batch).view(*batch.input_ids.shape, -1)[:, :-1]
        loss = torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch.input_ids[:, 1:].flatten(), reduction="none")
        loss = (loss * batch.mask.flatten()).sum() / batch.mask.sum()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return {"probe_loss": float(loss.detach())}

    def shipped(self):
        return None

    def receive(self, weights):
        pass

    def state_dict(self):
        return {"optimizer": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.opt.load_state_dict(state["optimizer"])


def _batch(model):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (3, 5, 4)]
    completions = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (4, 2, 3)]
    return pack([Completion(p, c, torch.full((len(c),), -1.0), 0, "length") for p, c in zip(prompts, completions)])


def _update(probe):
    model = tiny_model(seed=3)
    learner = Learner(model, 1e-2, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    if probe is not None:
        learner.add_aux_loss(probe)
    passes = []
    model.model.norm.register_forward_hook(lambda *_: passes.append(1))  # once per pass of the policy
    m, _ = learner.rl_step(_batch(model), torch.tensor([1.0, -0.5, -0.5]))
    return learner, m, len(passes)


def test_aux_loss_learns_from_the_rl_forward():
    probe = Probe(64, 48)
    assert isinstance(probe, aux_loss.AuxLoss)
    before = [p.detach().clone() for p in probe.head.parameters()]
    learner, m, passes = _update(probe)
    plain, _, plain_passes = _update(None)
    assert passes == plain_passes == 1 and probe.seen == [1]  # the policy ran once; the probe read that pass
    assert "probe_loss" in m and any(not torch.equal(a, b) for a, b in zip(before, probe.head.parameters()))
    # no gradient reached the policy: its update is the one without the probe, bit for bit
    for (k, a), b in zip(learner.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), k
    state = learner.optimizer_state()
    assert "probe" in state and state["probe"]["optimizer"]["state"]
    fresh = Probe(64, 48)
    learner.aux_losses = [fresh]
    learner.load_optimizer_state(state, 1e-2)
    assert fresh.opt.state_dict()["state"].keys() == probe.opt.state_dict()["state"].keys()
    with pytest.raises(ValueError, match="already registered"):
        learner.add_aux_loss(Probe(64, 48))


def test_negative_control_a_loss_that_runs_its_own_pass_is_counted():
    _, _, passes = _update(Probe(64, 48, second_pass=True))
    assert passes == 2
