"""Checkpoints against a hostile or damaged run directory, a full disk, and mixed file modes.

A resume reads only regular files inside the run directory, checks each checkpoint folder's name against its
manifest and its trainer state's parts and types, and falls back past anything else to the previous good
checkpoint in one warning line; it removes what a killed save left. A full disk at checkpoint time is one
line and exit code 2, the previous checkpoint intact. Every file a checkpoint holds has the same, normal mode.
"""
import contextlib
import errno
import json
import os
import shutil
import signal
import stat
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from test_faults import TINY

from nemo_rz import atomic, config, train
from nemo_rz.runtime import checkpoint, runlock
from nemo_rz.runtime.trainer import Trainer

RUN = ["algo.updates=3", "checkpoint.every=1", "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished three-update run with a checkpoint after each update."""
    run = tmp_path_factory.mktemp("safety") / "run"
    assert train.main(TINY + [f"run_dir={run}", *RUN]) == 0
    runlock.unlock(run)
    return run


@pytest.fixture
def run(base, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base, copy, symlinks=True)
    return copy


class Hung(BaseException):
    """Not an OSError (which a reader may catch as a damaged file, then go on to hang on the next one)."""


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (an open() of a FIFO, a read of /dev/zero)."""
    def expired(*_):
        raise Hung(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def resume(run: Path, *overrides) -> tuple[Trainer, list[str]]:
    """A trainer resumed from `run` (restored, not run), and what it logged."""
    lines = []
    cfg = config.load(None, TINY + [f"run_dir={run}", *RUN, *overrides])
    with deadline(120):
        trainer = Trainer(cfg, run, resume=run, log=lambda *a: lines.append(" ".join(map(str, a))))
    return trainer, lines


def close(trainer: Trainer) -> None:
    trainer.metrics_log.close()
    runlock.unlock(trainer.run_dir)


def resign(step: Path) -> None:
    """What an attacker who rewrites files also does: make the manifest match them."""
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    manifest["sha256"] = {n: checkpoint._sha256(step / n) for n in checkpoint.FILES}
    manifest["bytes"] = {n: (step / n).stat().st_size for n in checkpoint.FILES}
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))


def replace(path: Path, make) -> None:
    path.unlink()
    make(path)


def edit_state(run: Path, edit) -> None:
    step = run / "checkpoints" / "step_000003"
    state = torch.load(step / "state.pt", weights_only=True)
    state = edit(state)
    (step / "state.pt").unlink()
    torch.save(state, step / "state.pt")
    resign(step)


def mknod_zero(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 5))  # what /dev/zero is
    except PermissionError:
        pytest.skip("making a device node needs root")


S3 = "checkpoints/step_000003"
CASES = {
    # name: (what is done to the run, the warning, the checkpoint the resume falls back to)
    "state.pt -> /dev/zero": (lambda r: replace(r / S3 / "state.pt", lambda p: p.symlink_to("/dev/zero")),
                              "step_000003: state.pt is a symlink (to /dev/zero), not a regular file of this run; not read", 2),
    "manifest -> /dev/zero": (lambda r: replace(r / S3 / "manifest.json", lambda p: p.symlink_to("/dev/zero")),
                              "manifest.json is a symlink (to /dev/zero)", 2),
    "model.safetensors a FIFO": (lambda r: replace(r / S3 / "model.safetensors", os.mkfifo),
                                 "step_000003: model.safetensors is a FIFO, not a regular file", 2),
    "optimizer.pt a device": (lambda r: replace(r / S3 / "optimizer.pt", mknod_zero), "optimizer.pt is a device", 2),
    "optimizer.pt a 1 TB sparse file": (lambda r: os.truncate(r / S3 / "optimizer.pt", 1 << 40),
                                        "optimizer.pt does not match its checksum (1099511627776 bytes, the manifest says", 2),
    "a folder symlinked to another run's": (
        lambda r: (r / "checkpoints" / "step_000099").symlink_to(r.parent / "other" / S3),
        "step_000099 is a symlink (to ", 3),
    "a folder renamed": (lambda r: shutil.copytree(r / "checkpoints" / "step_000001", r / "checkpoints" / "step_000099"),
                         "step_000099: its manifest.json is of update 1, not 99 (renamed, or copied from another run)", 3),
    "a checkpoint file instead of a folder": (lambda r: (r / "checkpoints" / "step_000099").write_bytes(b"x"),
                                              "step_000099 is a file, not a folder of this run", 3),
    "state.pt without its keys": (lambda r: edit_state(r, lambda s: {"version": 3}), "step_000003: state.pt has no 'counts'", 2),
    "state.pt with a wrong type": (lambda r: edit_state(r, lambda s: {**s, "lags": "0 1 2"}),
                                   "state.pt['lags'] is str, not a list", 2),
    "state.pt with a wrong nested type": (lambda r: edit_state(r, lambda s: {**s, "is_dev": {"values": [1.0, "x"], "n_nonfinite": 0}}),
                                          "state.pt['is_dev']['values'][1] is str, not a number", 2),
    "state.pt of another update": (lambda r: edit_state(r, lambda s: {**s, "version": 2}), "state.pt is of update 2, not 3", 2),
    "state.pt not a table": (lambda r: edit_state(r, lambda s: [s]), "state.pt holds list, not a table", 2),
    "weights of another model": (lambda r: (save_file({"w": torch.zeros(2)}, r / S3 / "model.safetensors"), resign(r / S3)),
                                 "step_000003: model.safetensors lacks ", 2),
    "history of another model": (lambda r: (save_file({"v2/w": torch.zeros(2)}, r / S3 / "history.safetensors"), resign(r / S3)),
                                 "step_000003: history.safetensors (version 2) lacks ", 2),
    "history with a foreign tensor": (lambda r: (save_file({"junk": torch.zeros(2)}, r / S3 / "history.safetensors"), resign(r / S3)),
                                      "history.safetensors holds 'junk', not a weight version's tensor", 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_or_damaged_checkpoint_is_skipped_in_one_line(run, case):
    mutate, warning, fallback = CASES[case]
    shutil.copytree(run, run.parent / "other", symlinks=True)
    mutate(run)
    outside = {p: p.read_bytes() for p in (run.parent / "other" / "checkpoints").rglob("*") if p.is_file()}
    trainer, lines = resume(run)
    close(trainer)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and warning in warnings[0] and "falling back to the previous checkpoint" in warnings[0], lines
    assert "\n" not in warnings[0]
    assert trainer.version == fallback and any(f"resumed from {run / 'checkpoints' / f'step_{fallback:06d}'}" in line for line in lines)
    for step in (1, 2, 3)[:fallback]:  # the good checkpoints are all still there
        checkpoint.verify(run / "checkpoints" / f"step_{step:06d}")
    assert {p: p.read_bytes() for p in outside} == outside  # nothing outside the run was touched


def test_an_intact_run_resumes_from_its_newest_checkpoint(run):  # negative control of the table above
    trainer, lines = resume(run)
    close(trainer)
    assert trainer.version == 3 and not [line for line in lines if "warning" in line or "removed" in line]


def test_a_foreign_checkpoint_never_rotates_the_good_ones_out(run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other, symlinks=True)
    (run / "checkpoints" / "step_000099").symlink_to(other / "checkpoints" / "step_000002")
    (run / "checkpoints" / "step_000098").mkdir()  # an empty (damaged) folder that sorts newest too
    trainer, lines = resume(run, "algo.updates=5", "checkpoint.keep=2")
    try:
        with deadline(300):
            trainer.run()
    finally:
        close(trainer)
    assert "resumed from" in lines[-1] and "step_000003" in lines[-1]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_000004", "step_000005", "step_000098", "step_000099"]  # keep=2 good ones, the bad ones left alone
    for name in ("step_000004", "step_000005"):
        checkpoint.verify(run / "checkpoints" / name)
    checkpoint.verify(other / "checkpoints" / "step_000002")  # the other run's checkpoint: untouched
    assert [p.name for p in (other / "checkpoints").iterdir()] and os.path.islink(run / "checkpoints" / "step_000099")


def test_a_resume_removes_what_a_killed_save_left(run):
    ckpts = run / "checkpoints"
    half = ckpts / ".step_000004.tmp-k1ll3d00"  # SIGKILL while writing step 4
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    aside = ckpts / ".step_000002.old-k1ll3d00"  # SIGKILL while replacing step 2, between its two renames
    (ckpts / "step_000002").rename(aside)
    other = ckpts / ".config.yaml.tmp-abcd"  # not a checkpoint's leftover: left alone
    other.write_text("x")
    trainer, lines = resume(run)
    close(trainer)
    assert trainer.version == 3
    assert [line for line in lines if "half-written" in line] == [
        "resume: removed 1 half-written checkpoint folder(s) left by an interrupted save (.step_000004.tmp-k1ll3d00)"]
    assert any("put back checkpoint(s) step_000002" in line for line in lines)
    assert sorted(p.name for p in ckpts.iterdir()) == [".config.yaml.tmp-abcd", "step_000001", "step_000002", "step_000003"]
    checkpoint.verify(ckpts / "step_000002")


def test_a_resume_without_leftovers_says_nothing_of_them(run):  # negative control
    trainer, lines = resume(run)
    close(trainer)
    assert not [line for line in lines if "half-written" in line or "put back" in line]


# -- refusals: one line, exit code 2 -------------------------------------------------------------------

def _all_state_to_dev_zero(run: Path) -> None:
    for step in (run / "checkpoints").iterdir():
        replace(step / "state.pt", lambda p: p.symlink_to("/dev/zero"))


def _checkpoints_symlinked(run: Path) -> None:
    shutil.move(run / "checkpoints", run.parent / "elsewhere")
    (run / "checkpoints").symlink_to(run.parent / "elsewhere")


def _lock_symlinked(run: Path) -> None:
    (run.parent / "precious").write_text("not to be truncated")
    (run / runlock.LOCK_FILE).unlink()
    (run / runlock.LOCK_FILE).symlink_to(run.parent / "precious")


def _lock_a_fifo(run: Path) -> None:
    (run / runlock.LOCK_FILE).unlink()
    os.mkfifo(run / runlock.LOCK_FILE)


@pytest.mark.parametrize("mutate, message", [
    (_all_state_to_dev_zero, "none of its 3 checkpoints is intact; start a new run in another run_dir"),
    (_checkpoints_symlinked, "checkpoints is a symlink (to "),
    (_lock_symlinked, ".lock is a symlink (to "),
    (_lock_a_fifo, ".lock is not a regular file, not the lock file a trainer makes; remove it"),
])
def test_a_resume_with_no_usable_checkpoint_is_one_line_and_exit_2(run, capfd, mutate, message):
    mutate(run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and not p.is_symlink()}
    with deadline(120):
        assert train.main([f"resume={run}"]) == 2
    runlock.unlock(run)
    err = capfd.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in before} == before  # nothing written is lost
    if (run.parent / "precious").exists():
        assert (run.parent / "precious").read_text() == "not to be truncated"


# -- a full disk at checkpoint time ----------------------------------------------------------------------

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _inject_write(monkeypatch, file_name: str) -> None:
    """The disk fills while torch.save writes the second checkpoint's `file_name`: part of it lands, then ENOSPC."""
    real = atomic.write_all

    def write_all(fd, data):
        where = os.readlink(f"/proc/self/fd/{fd}")
        if ".step_000002.tmp-" in where and where.endswith(file_name):
            view = memoryview(data).cast("B")
            os.write(fd, view[: view.nbytes // 2])
            raise ENOSPC
        return real(fd, data)

    monkeypatch.setattr(atomic, "write_all", write_all)


def _inject_safetensors(monkeypatch, file_name: str) -> None:
    """safetensors' own error for a full disk (as a real one reads), on the second checkpoint's `file_name`."""
    real = checkpoint.save_file

    def save_file(tensors, path, metadata=None):
        if ".step_000002.tmp-" in str(path) and str(path).endswith(file_name):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoint, "save_file", save_file)


@pytest.mark.parametrize("inject, file_name", [
    (_inject_safetensors, "model.safetensors"), (_inject_safetensors, "history.safetensors"),
    (_inject_write, "optimizer.pt"), (_inject_write, "state.pt"), (_inject_write, "manifest.json"),
])
def test_a_full_disk_at_checkpoint_time_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capfd, monkeypatch, inject, file_name):
    run = tmp_path / "run"
    inject(monkeypatch, file_name)
    assert train.main(TINY + [f"run_dir={run}", *RUN]) == 2
    runlock.unlock(run)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert (f"error: {run / 'checkpoints'}: No space left on device while writing checkpoint step_000002 "
            f"(the last checkpoint, step_000001, is kept); free some space, then resume with resume={run}") in err
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000001"]  # no half-written folder left
    _, (_, _, _, state) = checkpoint.load_latest(run / "checkpoints")
    checkpoint.check_trainer_state(run / "checkpoints" / "step_000001", state)


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                           check=False, capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")


def _fill(disk: Path, leave: int) -> None:
    """Fill the file system at `disk` but for `leave` bytes."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "ballast", "ab") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(free - leave, 0))


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_a_really_full_disk_at_checkpoint_time(tmp_path, capfd, monkeypatch, writer):
    """No injected fault: the second checkpoint hits a full tmpfs (in safetensors' write, or torch.save's)."""
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "64m")
    try:
        run = disk / "run"
        real_save, calls, real_torch_save, torch_failed = Trainer.save, [], torch.save, []

        def save(self):
            if calls:  # the second checkpoint: leave room for the safetensors files only, or for nothing
                first = run / "checkpoints" / "step_000001"
                size = {n: (first / n).stat().st_size for n in ("model.safetensors", "history.safetensors")}
                room = size["model.safetensors"] + 2 * size["history.safetensors"] + 16384  # its history: one version more
                _fill(disk, room if writer == "torch.save" else 0)
            calls.append(1)
            return real_save(self)

        def spy(*args, **kwargs):  # which writer met the full disk
            try:
                return real_torch_save(*args, **kwargs)
            except BaseException as e:
                torch_failed.append(type(e).__name__)
                raise

        monkeypatch.setattr(Trainer, "save", save)
        monkeypatch.setattr(torch, "save", spy)
        assert train.main(TINY + [f"run_dir={run}", *RUN]) == 2
        runlock.unlock(run)
        assert bool(torch_failed) == (writer == "torch.save"), torch_failed
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "No space left on device while writing checkpoint step_000002 (the last checkpoint, step_000001, is kept)" in err
        assert sorted(os.listdir(run / "checkpoints")) == ["step_000001"]
        checkpoint.load(run / "checkpoints" / "step_000001")
        (disk / "ballast").unlink()  # space freed: the run resumes
        monkeypatch.undo()
        trainer, _ = resume(run)
        try:
            trainer.run()
        finally:
            close(trainer)
        assert trainer.version == 3 and sorted(os.listdir(run / "checkpoints")) == ["step_000001", "step_000002", "step_000003"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# -- file modes --------------------------------------------------------------------------------------------

def test_every_checkpoint_file_has_a_normal_mode(base):
    mode = 0o666 & ~atomic.umask()
    for step in (base / "checkpoints").iterdir():
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in step.iterdir()} == {
            n: oct(mode) for n in (checkpoint.MANIFEST, *checkpoint.FILES)}
        assert step.stat().st_mode & 0o777 == 0o777 & ~atomic.umask()


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_checkpoint_files_follow_the_umask(tmp_path, mask):
    old = os.umask(mask)
    try:
        assert atomic.umask() == mask
        w = {"w": torch.ones(4)}
        step = checkpoint.save(tmp_path, w, {0: w}, {"state": {}}, {"version": 1}, keep=2)
    finally:
        os.umask(old)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in step.iterdir()} == {
        n: oct(0o666 & ~mask) for n in (checkpoint.MANIFEST, *checkpoint.FILES)}
    assert step.stat().st_mode & 0o777 == 0o777 & ~mask


def test_a_manifest_from_before_sizes_were_recorded_still_verifies(tmp_path):
    w = {"w": torch.ones(4)}
    step = checkpoint.save(tmp_path, w, {0: w}, {"state": {}}, {"version": 1}, keep=2)
    manifest = json.loads((step / checkpoint.MANIFEST).read_text())
    del manifest["bytes"]
    (step / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    checkpoint.verify(step)
    (step / "state.pt").write_bytes((step / "state.pt").read_bytes() + b"x")  # negative control: the checksum still counts
    with pytest.raises(checkpoint.CorruptCheckpoint, match="state.pt does not match its checksum"):
        checkpoint.verify(step)


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
def test_metrics_file_planted_in_a_run_is_refused(tmp_path, planted):
    """metrics.jsonl is appended only as the run's own regular file: a symlink planted in its place (to a file
    outside the run) or a FIFO is refused in one line, and the file it points to is untouched."""
    from nemo_rz.errors import BadInput
    from nemo_rz.runtime.metrics_log import MetricsLog

    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    if planted == "symlink":
        (run / "metrics.jsonl").symlink_to(outside)
    else:
        os.mkfifo(run / "metrics.jsonl")
    log = MetricsLog(run)
    with pytest.raises(BadInput, match="metrics.jsonl is"):
        log.write({"update": 1})
    with pytest.raises(BadInput, match="metrics.jsonl is"):
        log.keep_until(0)
    assert outside.read_text() == "precious\n"
    (run / "metrics.jsonl").unlink()  # negative control: the run's own file is written and kept
    log.write({"update": 1})
    log.keep_until(1)
    assert (run / "metrics.jsonl").read_text() == '{"update": 1}\n'


def test_weight_versions_that_share_a_frozen_tensor_are_written_once_and_load_as_saved(tmp_path):
    """LoRA versions share their frozen base: the history holds it once and names it again in its metadata;
    versions that share nothing (full fine-tuning) write every tensor (the negative control of the count)."""
    base = torch.randn(64, 32)
    history = {v: {"base.weight": base, "lora_B.weight": torch.full((4, 32), float(v))} for v in (3, 4, 5)}
    state = {"version": 5}
    ckpt = checkpoint.save(tmp_path, {"base.weight": base}, history, {}, state, keep=2)
    _, loaded, _, _ = checkpoint.load(ckpt)
    assert sorted(loaded) == [3, 4, 5]
    assert all(torch.equal(loaded[v][k], t) for v in history for k, t in history[v].items())
    with safe_open(ckpt / "history.safetensors", "pt") as f:
        assert len(list(f.keys())) == 1 + 3
    unshared = {v: {k: t.clone() for k, t in sd.items()} for v, sd in history.items()}
    with safe_open(checkpoint.save(tmp_path / "b", {}, unshared, {}, state, keep=2) / "history.safetensors", "pt") as f:
        assert len(list(f.keys())) == 3 + 3
