"""Divergence is detected, named (update and quantity), has its own exit code, and never costs the last good
checkpoint."""
import pytest
import torch
from conftest import tiny_model
from omegaconf import OmegaConf
from safetensors.torch import load_file

from nemo_rz import config, train
from nemo_rz.errors import DivergenceError
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.runtime import checkpoint, learner
from nemo_rz.runtime.learner import Learner
from nemo_rz.runtime.trainer import Trainer

TINY = [
    "task.name=add1", "warmup.steps=40", "warmup.lr=0.003", "algo.prompts_per_update=4", "algo.group_size=4", "eval.n=8",
    "eval.every=0", "model.hidden_size=32", "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false",
    "metrics.decomposition_every=0",
]


@pytest.mark.parametrize("lr", ["1e6", "1e30"])
def test_a_huge_learning_rate_is_a_divergence_not_a_success_or_a_mismatch(tmp_path, capsys, lr):
    assert train.main(TINY + [f"run_dir={tmp_path / 'r'}", "algo.updates=4", f"algo.lr={lr}"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: training diverged at update 1: weight norm grew"), err
    assert f"lower algo.lr (now {float(lr):g})" in err and "temperature" not in err
    assert not (tmp_path / "r" / "summary.json").exists()


def test_warm_up_divergence_names_warmup_lr(tmp_path, capsys):
    assert train.main(TINY + [f"run_dir={tmp_path / 'r'}", "algo.updates=2", "warmup.lr=1e6"]) == 3
    assert "diverged at warm-up step 1" in capsys.readouterr().err


def _run_that_diverges_after_update_2(tmp_path, name):
    cfg = config.load(None, TINY + [f"run_dir={tmp_path / name}", "algo.updates=6", "checkpoint.every=2", "checkpoint.keep=1"])
    (tmp_path / name).mkdir()
    trainer = Trainer(cfg, tmp_path / name, log=lambda *_: None)

    def blow_up_after_2(record):
        if record["update"] == 2:  # as if the learning rate had been far too high from here on
            for g in trainer.learner.opt.param_groups:
                g["lr"] = 1e6
    return trainer, blow_up_after_2


def test_the_last_good_checkpoint_survives_divergence(tmp_path):
    trainer, hook = _run_that_diverges_after_update_2(tmp_path, "d")
    with pytest.raises(DivergenceError, match=r"at update 3: .*the last good checkpoint, step_000002, is kept"):
        trainer.run(hook)
    ckpts = tmp_path / "d" / "checkpoints"
    assert [p.name for p in checkpoint.checkpoints(ckpts)] == ["step_000002"]
    weights = load_file(checkpoint.latest(ckpts) / "model.safetensors")
    assert max(float(w.abs().max()) for w in weights.values()) < 100
    assert len((tmp_path / "d" / "metrics.jsonl").read_text().splitlines()) == 2
    # The advice works: resume with a lower algo.lr, which replaces the one saved in the optimizer state.
    (tmp_path / "d" / "config.yaml").write_text(OmegaConf.to_yaml(trainer.cfg))
    cfg = config.load(None, [f"resume={tmp_path / 'd'}", "algo.lr=1e-4"])
    resumed = Trainer(cfg, tmp_path / "d", resume=tmp_path / "d", log=lambda *_: None)
    assert resumed.version == 2 and resumed.learner.opt.param_groups[0]["lr"] == 1e-4
    assert resumed.run()["updates"] == 6


def test_negative_control_without_the_check_the_good_checkpoint_is_rotated_out(tmp_path, monkeypatch):
    monkeypatch.setattr(learner, "MAX_WEIGHT_GROWTH", float("inf"))
    trainer, hook = _run_that_diverges_after_update_2(tmp_path, "n")
    trainer.run(hook)  # exit 0, as before the check existed
    ckpts = tmp_path / "n" / "checkpoints"
    assert [p.name for p in checkpoint.checkpoints(ckpts)] == ["step_000006"]
    weights = load_file(checkpoint.latest(ckpts) / "model.safetensors")
    assert max(float(w.abs().max()) for w in weights.values()) > 1e5


def test_nan_weights_are_blamed_on_the_learner_not_on_a_mismatch():
    model = tiny_model()
    outs = RolloutEngine(model, max_batch_size=4).generate([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]], SamplingParams(6, 1.0, seed=0))
    batch, adv = pack(outs), torch.tensor([1.0, -1.0, 0.5, -0.5])
    learn = Learner(model, 1e-4, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    learn.rl_step(batch, adv)  # control: healthy weights step without complaint
    with torch.no_grad():
        dict(model.named_parameters())["model.layers.0.input_layernorm.weight"][0] = float("nan")  # every token
    with pytest.raises(DivergenceError, match="update 7: the learner's logprobs are NaN"):
        learn.rl_step(batch, adv, "update 7")
