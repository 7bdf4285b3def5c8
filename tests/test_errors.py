"""errors.py owns the error hierarchy, and the command line maps each kind to its exit code in one line:
bad input 2, divergence 3 (non-finite ratios and -inf learner logprobs included), failing workers 4."""
import ast
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from nemo_rz import errors, train
from nemo_rz.algorithms import importance_weights
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.runtime.learner import Learner

ROOT = Path(__file__).resolve().parent.parent

KINDS = [
    (errors.ConfigError("algo.lr = 'x': expected a number"), 2),
    (errors.ModelFileError("config.json:\n  bad"), 2),
    (errors.CorruptCheckpoint("checkpoint step_2: damaged"), 2),
    (errors.OptionError("task.options.n_train = 'abc'"), 2),
    (errors.PluginError("correction 'x': unknown"), 2),
    (errors.RunDirInUse("run_dir r: in use"), 2),
    (ValueError("a plain bad value"), 2),
    (errors.DivergenceError("update 3: loss is nan"), 3),
    (errors.NonFiniteRatioError("1 valid token(s) with a non-finite ratio"), 3),
    (errors.WorkerFailed("rollout worker 0 failed 3 times"), 4),
]


@pytest.mark.parametrize("exc,code", KINDS, ids=[type(e).__name__ for e, _ in KINDS])
def test_each_kind_has_its_exit_code_and_one_line(monkeypatch, capsys, tmp_path, exc, code):
    def fail(cfg, run_dir):
        raise exc

    monkeypatch.setattr(train, "run", fail)
    assert train.main([f"run_dir={tmp_path / 'r'}", "progress=false"]) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


def test_exit_codes_are_distinct():
    codes = [errors.EXIT_BAD_INPUT, errors.EXIT_DIVERGED, errors.EXIT_WORKER_FAILED, errors.EXIT_INTERRUPTED,
             errors.EXIT_TERMINATED]
    assert len(set(codes)) == len(codes)


def test_public_exceptions_live_in_errors_py():
    """No module defines a public exception class of its own: they are errors.py's (private helpers may)."""
    found = []
    for f in sorted((ROOT / "nemo_rz").rglob("*.py")):
        if f.name == "errors.py" and f.parent.name == "nemo_rz":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                if bases & {"Exception", "ValueError", "RuntimeError", "KeyboardInterrupt", "OSError"} or node.name.endswith("Error"):
                    found.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == []


def _batch():
    model = tiny_model()
    outs = RolloutEngine(model, max_batch_size=4).generate([[1, 2, 3], [4, 5]], SamplingParams(4, 1.0, seed=0))
    return model, pack(outs), torch.tensor([1.0, -1.0])


def test_a_non_finite_ratio_is_divergence():
    model, batch, adv = _batch()
    batch.rollout_logprobs[0, batch.mask[0].nonzero()[0, 0]] = float("-inf")  # the rollout gave it probability 0
    with pytest.raises(errors.DivergenceError, match="non-finite"):
        Learner(model, 1e-4, 1.0, 1.0, "reinforce_zero", "unclipped", {}).rl_step(batch, adv)
    with pytest.raises(ValueError):  # still a ValueError for library callers
        importance_weights(torch.zeros(1, 1), torch.full((1, 1), float("-inf")), torch.ones(1, 1), "unclipped")


def test_a_minus_inf_learner_logprob_is_divergence(monkeypatch):
    model, batch, adv = _batch()
    learner = Learner(model, 1e-4, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    learner.rl_step(batch, adv)  # control: finite logprobs step without complaint
    real = model.token_logprobs

    def zero_probability(*args, **kwargs):
        lp = real(*args, **kwargs)
        return torch.where(batch.mask.bool() & (torch.arange(lp.shape[1]) == batch.mask[1].nonzero()[0, 0]),
                           torch.full_like(lp, float("-inf")), lp)

    monkeypatch.setattr(model, "token_logprobs", zero_probability)
    with pytest.raises(errors.DivergenceError, match=r"update 5: the learner's logprobs are -inf on 1 sampled token"):
        learner.rl_step(batch, adv, "update 5")
