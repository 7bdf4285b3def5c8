"""The asynchronous runtime: lag bound, accounting, kernel-vs-lag decomposition, crash recovery, resume."""
import collections
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from nemo_rz import config, train
from nemo_rz.runtime import build, checkpoint
from nemo_rz.runtime.jobs import Job
from nemo_rz.runtime.trainer import Trainer
from nemo_rz.tasks import Problem

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


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    """(summary, run directory) of a 6-update run at max_lag 2: checked itself, and the uninterrupted run that a
    stopped and resumed one must equal."""
    root = tmp_path_factory.mktemp("async")
    _, summary = _run(root, "a", "algo.updates=6", "algo.max_lag=2")
    return summary, root / "a"


def test_async_run_respects_lag_and_accounts_for_every_trajectory(async_run):
    summary, run_dir = async_run
    rows = _metrics(run_dir)
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


def test_resume_continues_bit_exactly(tmp_path, async_run):
    _, full = async_run
    _run(tmp_path, "part", "algo.updates=3", "algo.max_lag=2")
    part = tmp_path / "part"
    (part / "config.yaml").write_text((part / "config.yaml").read_text() if (part / "config.yaml").exists() else "")
    cfg = config.load(None, TINY + [f"run_dir={part}", "algo.updates=6", "algo.max_lag=2"])
    Trainer(cfg, part, resume=part, log=lambda *_: None).run()
    full_w = load_file(checkpoint.latest(full / "checkpoints") / "model.safetensors")
    part_w = load_file(checkpoint.latest(part / "checkpoints") / "model.safetensors")
    assert full_w.keys() == part_w.keys() and all(torch.equal(full_w[k], part_w[k]) for k in full_w)
    def strip(rows):
        return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]

    assert strip(_metrics(part)) == strip(_metrics(full))


def _tag_draws(trainer):
    """Tag every answer the task draws with how many times its batch was drawn; returns (draws, tags scored)."""
    task, draws, scored = trainer.task, collections.Counter(), []
    sample, reward = task.sample, task.reward

    def tagged_sample(n, rng):
        key = rng.getstate()
        draws[key] += 1
        return [Problem(p.prompt, f"{p.answer}#{draws[key]}") for p in sample(n, rng)]

    def tagged_reward(completion, answer):
        answer, tag = answer.rsplit("#", 1)
        scored.append(int(tag))
        return reward(completion, answer)

    task.sample, task.reward = tagged_sample, tagged_reward
    return draws, scored


class _Redraws(Trainer):
    """The way before Job.answers: the answers drawn again when the result is scored."""

    def _update(self, res):
        self.answers[res.batch] = self.job(res.batch).answers
        return super()._update(res)


@pytest.mark.parametrize("cls, tag", [(Trainer, 1), (_Redraws, 2)])  # _Redraws: the negative control
def test_completions_are_scored_against_the_answers_drawn_with_their_prompts(tmp_path, cls, tag):
    cfg = config.load(None, TINY + [f"run_dir={tmp_path / 'r'}", "algo.updates=3", "algo.max_lag=1", "checkpoint.every=0"])
    trainer = cls(cfg, tmp_path / "r", log=lambda *_: None)
    draws, scored = _tag_draws(trainer)
    assert trainer.run()["trained"] == 3 * 16
    assert len(scored) == 3 * 16 and set(scored) == {tag}
    assert len(draws) == 3 and set(draws.values()) == {tag}  # one draw per batch: sample() called once for each


def _checkpoint_with_batch_1_pending(tmp_path, name, stored):
    """A run saved at update 0 holding batch 1's result, as save() writes it when batch 1 came back before batch 0,
    with stored = "its answers", "none" (a checkpoint written before Job.answers) or "batch 2's answers"."""
    run = tmp_path / name
    cfg = config.load(None, TINY + [f"run_dir={run}", "algo.updates=3", "algo.max_lag=1"])
    trainer = Trainer(cfg, run, log=lambda *_: None)
    weights = trainer.history[0].flat()
    backend = build.backend(trainer.cfg.runtime, 1, build.worker_kwargs(trainer.cfg, trainer.parts), weights)
    try:
        backend.publish(0, weights)
        job = trainer.job(1)
        backend.submit(job)
        results = []
        while not results:
            results = backend.poll(timeout=5.0)
    finally:
        backend.close()
    trainer.pending[1], trainer.answers[1] = results[0], job.answers
    trainer.counts["produced"] += len(results[0].completions)
    path = trainer.save()
    if stored != "its answers":
        saved = checkpoint.load(path)
        row = saved[3]["pending"][1]
        saved[3]["pending"][1] = row[:5] + ((trainer.job(2).answers,) if stored == "batch 2's answers" else ())
        shutil.rmtree(path)
        checkpoint.save(run / "checkpoints", *saved, keep=1)
    return cfg, run


def test_results_pending_in_a_checkpoint_are_scored_against_their_answers_also_from_an_old_one(tmp_path):
    _run(tmp_path, "full", "algo.updates=3", "algo.max_lag=1")
    final = {}
    for stored in ("its answers", "none", "batch 2's answers"):  # batch 2's: the negative control
        cfg, run = _checkpoint_with_batch_1_pending(tmp_path, stored.split()[0], stored)
        summary = Trainer(cfg, run, resume=run, log=lambda *_: None).run()
        assert summary["produced"] == summary["trained"] == 3 * 16
        final[stored] = load_file(checkpoint.latest(run / "checkpoints") / "model.safetensors")
    full = load_file(checkpoint.latest(tmp_path / "full" / "checkpoints") / "model.safetensors")
    assert all(torch.equal(full[k], final["its answers"][k]) and torch.equal(full[k], final["none"][k]) for k in full)
    assert not all(torch.equal(full[k], final["batch 2's answers"][k]) for k in full)


def test_answers_must_match_the_prompts_and_a_checkpoint_whose_answers_do_not_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^job 0: 2 answers for 1 prompts; give one per prompt$"):
        Job(0, 0, [[1]], 1, 1.0, seed=0, stop_token_ids=(), answers=["3", "4"])
    row = ([1], [2], b"\0" * 4, 0, "stop")
    state = dict(version=0, counts={}, lags=[], is_dev={"values": [], "n_nonfinite": 0}, evals=[(0, 0.0)], max_grad_norm=0.0,
                 pending={1: (0, 0, [row, row], 0.5, {}, ["3", "4"])}, torch_rng=torch.get_rng_state(), elapsed=0.0)
    checkpoint.check_trainer_state(tmp_path / "step_000000", state)  # one answer per completion
    state["pending"][1] = (0, 0, [row, row], 0.5, {})  # written before Job.answers: none
    checkpoint.check_trainer_state(tmp_path / "step_000000", state)
    state["pending"][1] = (0, 0, [row, row], 0.5, {}, ["3"])
    with pytest.raises(checkpoint.CorruptCheckpoint, match=r"state.pt\['pending'\]\[1\] holds 1 answers for 2 completions"):
        checkpoint.check_trainer_state(tmp_path / "step_000000", state)


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
