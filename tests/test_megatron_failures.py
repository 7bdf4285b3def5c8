"""A Megatron rank that fails stops the whole job: one line on stderr naming the rank and what happened, exit code
1, no process left behind (ranks, rollout workers), the last checkpoint intact, the rendezvous a private file.

Failures: a rank that raises (its exception's last line is quoted), one that is SIGSTOP'd (a hang: no heartbeat for
megatron.heartbeat_s seconds). A slow rank that still beats is not a failure (the negative control of the
heartbeat: a timeout on steps or collectives would stop it)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_failing_rank import FAULT  # noqa: E402
from test_signals import _descendants, _kill_all, _survivors  # noqa: E402

from nemo_rz.runtime import checkpoint  # noqa: E402
from nemo_rz.runtime.megatron import launch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["task.name=add1", "warmup.steps=10", "algo.prompts_per_update=4", "algo.group_size=4", "eval.n=8",
        "eval.every=0", "model.hidden_size=32", "model.intermediate_size=64", "progress=false",
        "metrics.tensorboard=false", "metrics.decomposition_every=0", "checkpoint.every=1", "algo.updates=100000",
        "runtime.learner=megatron", "megatron.tp=2"]

# A rank's whole life in a few lines of Python: beat (as the train CLI's ranks do), then behave as told; rank 0
# waits for rank 1 to finish (its file), at most 120 s.
RANK = """import os, pathlib, signal, sys, time
from nemo_rz.runtime import heartbeat
heartbeat.beat()
rank, what, done = int(os.environ["RANK"]), sys.argv[1], pathlib.Path(sys.argv[2])
if rank == 1:
    time.sleep(1.0)
    if what == "slow":
        time.sleep(4 * 3.0)  # 4 x heartbeat_s: a slow step, beating all along
    if what == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if what == "raise":
        raise RuntimeError("boom in a collective")
    done.touch()
else:
    t = time.monotonic()
    while not done.exists() and time.monotonic() < t + 120:
        time.sleep(0.1)
"""


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.startswith("note: ")]


@pytest.mark.parametrize("what", ["slow", "stop", "raise"])
@pytest.mark.slow
def test_the_launcher_tells_a_slow_rank_from_a_stopped_or_raising_one(what, capfd, tmp_path):
    t0 = time.monotonic()
    code = launch.start([sys.executable, "-c", RANK, what, str(tmp_path / "done")], 2, run_dir="RUN", heartbeat_s=3.0)
    err = _errors(capfd.readouterr().err)
    if what == "slow":  # negative control: silence is what trips, not time
        assert code == 0 and err == []
        return
    assert code == launch.EXIT_RANK_DIED and len(err) == 1, err
    assert err[0].startswith("error: rank 1 of 2 ") and err[0].endswith("resume with resume=RUN)")
    if what == "stop":
        assert "stopped responding: no heartbeat for " in err[0]
        assert "s (megatron.heartbeat_s = 3; its process was stopped)" in err[0]
    else:
        assert "ended with exit code 1 (RuntimeError: boom in a collective)" in err[0]
    assert time.monotonic() - t0 < 100  # caught while rank 0 was still waiting


def _cli(command: list[str], run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([*command, *TINY, f"run_dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _env(pid: int) -> dict[str, str]:
    try:
        items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(e.decode(errors="replace").split("=", 1) for e in items if b"=" in e)


def _run_to_failure(proc, run_dir, fail) -> tuple[str, dict[str, int], list[int], list[Path]]:
    """Wait for the first checkpoint (noting every process of the job on the way), fail the job with `fail`, wait
    for its end: its stderr, its ranks by rank, the processes that outlived it, its rendezvous folders."""
    seen, ranks, stores = set(), {}, set()
    deadline = time.monotonic() + 300
    try:
        while checkpoint.latest(run_dir / "checkpoints") is None or not {"0", "1"} <= set(ranks):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            for pid in _descendants(proc.pid):
                env = _env(pid)  # a rank's own once it has started (before, the launcher's)
                if launch.ENV_STORE in env:
                    ranks.setdefault(env["RANK"], pid)
                    stores.add(Path(env[launch.ENV_STORE]).parent)
                seen.add(pid)
            time.sleep(0.2)
        seen |= _descendants(proc.pid)  # the rollout workers too
        fail(ranks)
        _, err = proc.communicate(timeout=150)
        return err, ranks, _survivors(seen), sorted(stores)
    finally:
        _kill_all(proc, seen)


def _check_report(proc, run_dir, err, ranks, survivors, stores, *want):
    lines = _errors(err)
    assert proc.returncode == launch.EXIT_RANK_DIED, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: rank 1 of 2 "), lines
    assert all(w in lines[0] for w in want) and f"resume={run_dir}" in lines[0], lines[0]
    assert survivors == [], survivors
    assert stores and not any(s.exists() for s in stores)  # the private rendezvous folder is gone
    assert checkpoint.load_latest(run_dir / "checkpoints") is not None


@pytest.mark.slow
def test_a_stopped_rank_stops_the_training_job_after_its_heartbeat_timeout(tmp_path):
    run_dir = tmp_path / "run"
    proc = _cli([sys.executable, "-m", "nemo_rz.train", "megatron.heartbeat_s=8"], run_dir)
    report = _run_to_failure(proc, run_dir, lambda ranks: os.kill(ranks["1"], signal.SIGSTOP))
    _check_report(proc, run_dir, *report, "stopped responding: no heartbeat for", "heartbeat_s = 8",
                  "its process was stopped")


@pytest.mark.slow
def test_a_raising_rank_stops_the_training_job_with_its_error(tmp_path):
    run_dir = tmp_path / "run"
    proc = _cli([sys.executable, str(ROOT / "tests" / "megatron_failing_rank.py")], run_dir)
    report = _run_to_failure(proc, run_dir, lambda ranks: None)
    _check_report(proc, run_dir, *report, f"ended with exit code 1 ({FAULT})")


def test_the_watch_counts_a_rank_silence_not_its_own_absence(monkeypatch):
    from nemo_rz.runtime import heartbeat

    clock = [100.0]
    monkeypatch.setattr(heartbeat.time, "monotonic", lambda: clock[0])

    def watched():
        beating, starting = heartbeat.Pipe(), heartbeat.Pipe()
        os.write(beating.child_fds[0], b".")
        return heartbeat.Watch([beating, starting], timeout_s=5.0, startup_s=30.0), beating

    def tick(watch, seconds, beat=None):
        clock[0] += seconds
        if beat is not None:
            os.write(beat.child_fds[0], b".")
        return watch.silent()

    watch, beating = watched()
    assert watch.silent() is None
    assert all(tick(watch, 1.0, beating) is None for _ in range(10))  # beating: never silent
    assert tick(watch, 60.0) is None  # the watcher itself was away (Ctrl-Z stops the whole job): nobody's silence
    assert tick(watch, 1.0, beating) is None
    results = [tick(watch, 1.0) for _ in range(6)]  # rank 0 falls silent
    assert results[:4] == [None] * 4 and results[5] == (0, 6.0)
    watch, beating = watched()  # rank 1 never beats: it has the start-up time, not the heartbeat's
    assert all(tick(watch, 1.0, beating) is None for _ in range(30)) and tick(watch, 1.0, beating) == (1, 31.0)
    # negative control: a watcher that does not skip its own absence blames the ranks for it
    monkeypatch.setattr(heartbeat, "AWAY_S", float("inf"))
    watch, beating = watched()
    assert watch.silent() is None and tick(watch, 60.0) == (0, 60.0)
