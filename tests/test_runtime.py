"""The asynchronous runtime: lag bound, accounting, kernel-vs-lag decomposition, crash recovery, resume."""
import json

import pytest
import torch
from safetensors.torch import load_file

from nemo_rz import config, train
from nemo_rz.runtime import checkpoint
from nemo_rz.runtime.trainer import Trainer

TINY = [
    "task.name=add1", "warmup.steps=40", "warmup.lr=0.003", "algo.prompts_per_update=4", "algo.group_size=4", "eval.n=16", "eval.every=3",
    "model.hidden_size=32", "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false",
    "metrics.decomposition_every=1", "checkpoint.every=3",
]
TIMING = {"rollout_tokens_per_s", "learner_tokens_per_s", "queue_wait_s", "elapsed_s", "rollout_s", "learn_s",
          "spec_draft_time_share"}


def _run(tmp_path, name, *overrides):
    cfg = config.load(None, TINY + [f"run_dir={tmp_path / name}", *overrides])
    run_dir = tmp_path / name
    run_dir.mkdir(exist_ok=True)
    trainer = Trainer(cfg, run_dir, log=lambda *_: None)
    return trainer, trainer.run()


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_run_respects_lag_and_accounts_for_every_trajectory(tmp_path):
    trainer, summary = _run(tmp_path, "a", "algo.updates=6", "algo.max_lag=2")
    rows = _metrics(tmp_path / "a")
    assert [r["lag"] for r in rows] == [0, 1, 2, 2, 2, 2]
    assert summary["produced"] == summary["trained"] == 6 * 16 and summary["pending"] == 0
    assert summary["lag_histogram"] == [1, 1, 4]
    assert all(r["kernel_diff_tokens"] == 0 for r in rows)  # consistent mode: kernel mismatch is zero
    assert any(r["lag_k3"] > 0 for r in rows if r["lag"] > 0)  # the gap that remains is lag alone


def test_standard_kernels_on_the_rollout_side_show_kernel_mismatch(tmp_path):
    _, _ = _run(tmp_path, "f", "algo.updates=2", "algo.max_lag=1", "runtime.rollout_kernels=fast", "runtime.rollout_dtype=bfloat16")
    assert all(r["kernel_diff_tokens"] > 0 for r in _metrics(tmp_path / "f"))


def test_synchronous_mode_trains_on_fresh_data_only(tmp_path):
    _, summary = _run(tmp_path, "s", "algo.updates=3", "algo.max_lag=0")
    assert summary["lag_histogram"] == [3]
    rows = _metrics(tmp_path / "s")
    assert all(r["is_dev"] == 0.0 and r["rho_min"] == r["rho_max"] == 1.0 for r in rows)  # on-policy: rho == 1 exactly


def test_crashed_worker_is_restarted_and_its_batch_reissued(tmp_path):
    _, summary = _run(tmp_path, "c", "algo.updates=4", "algo.max_lag=1", "runtime.crash_worker_at_batch=2")
    rows = _metrics(tmp_path / "c")
    assert rows[-1]["worker_restarts"] == 1
    assert summary["produced"] == summary["trained"] == 4 * 16
    assert [r["batch"] for r in rows] == [0, 1, 2, 3]


def test_resume_continues_bit_exactly(tmp_path):
    _run(tmp_path, "full", "algo.updates=6", "algo.max_lag=2")
    _run(tmp_path, "part", "algo.updates=3", "algo.max_lag=2")
    part = tmp_path / "part"
    (part / "config.yaml").write_text((part / "config.yaml").read_text() if (part / "config.yaml").exists() else "")
    cfg = config.load(None, TINY + [f"run_dir={part}", "algo.updates=6", "algo.max_lag=2"])
    Trainer(cfg, part, resume=part, log=lambda *_: None).run()
    full_w = load_file(checkpoint.latest(tmp_path / "full" / "checkpoints") / "model.safetensors")
    part_w = load_file(checkpoint.latest(part / "checkpoints") / "model.safetensors")
    assert full_w.keys() == part_w.keys() and all(torch.equal(full_w[k], part_w[k]) for k in full_w)
    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert strip(_metrics(part)) == strip(_metrics(tmp_path / "full"))


def test_a_reward_function_that_raises_costs_the_sample_not_the_run(tmp_path):
    cfg = config.load(None, TINY + [f"run_dir={tmp_path / 'r'}", "algo.updates=2"])
    (tmp_path / "r").mkdir()
    trainer = Trainer(cfg, tmp_path / "r", log=lambda *_: None)
    verifier = trainer.task.verifier
    trainer.task.verifier = lambda text, answer: 1 / 0 if text.startswith("1") else verifier(text, answer)
    summary = trainer.run()
    assert summary["trained"] == 2 * 16 and summary["reward_errors"] > 0


def test_train_cli_runs_and_reports(tmp_path, capsys):
    run_dir = tmp_path / "cli"
    assert train.main(TINY + [f"run_dir={run_dir}", "algo.updates=3", "runtime.backend=local"]) == 0
    out = capsys.readouterr().out
    assert "held-out pass@1" in out and "produced 48 = trained 48" in out
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "plots/training.png"):
        assert (run_dir / name).exists(), name
    assert train.main([f"run_dir={run_dir}"]) == 2  # refuses to overwrite a run
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["algo.max_lga=3"], "unknown config key 'algo.max_lga' in the command line; did you mean algo.max_lag?"),
        (["algo.loss=dpo"], "algo.loss = 'dpo'"),
        (["task.name=add9"], "task.name = 'add9'"),
        (["--config", "missing.yaml"], "--config missing.yaml"),
        (["resume=/nonexistent/run"], "config.yaml not found"),
    ],
)
def test_bad_configuration_gets_one_clear_line(tmp_path, capsys, args, message):
    assert train.main(args + [f"run_dir={tmp_path / 'x'}"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_ray_backend_recovers_a_crashed_actor(tmp_path):
    pytest.importorskip("ray")
    _, summary = _run(tmp_path, "ray", "algo.updates=3", "algo.max_lag=1", "runtime.backend=ray", "runtime.crash_worker_at_batch=1")
    rows = _metrics(tmp_path / "ray")
    assert rows[-1]["worker_restarts"] == 1 and summary["produced"] == summary["trained"] == 3 * 16
    assert all(r["kernel_diff_tokens"] == 0 for r in rows)
