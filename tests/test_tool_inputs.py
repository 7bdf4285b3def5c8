"""Bad input to the command-line tools (check_mismatch, bisect, report, convert): one line on stderr naming the
argument or file, exit code 2, no traceback, nothing already written lost; sizes are checked against the model
and the machine before anything is allocated."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_rz.tools import bisect, check_mismatch, common, convert, report

ROOT = Path(__file__).resolve().parent.parent


def _one_line_exit_2(capsys, main, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, (argv, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert message in err, (argv, err)
    return err


# -- check_mismatch ------------------------------------------------------------------------------------------
CHECK_MISMATCH = {
    "batch size beyond the memory": (["--batch-sizes", "100000000"], "--batch-sizes 100000000: every batch size must be in 1.."),
    "largest batch size named": (["--batch-sizes", "1", "100000000"], "--batch-sizes 100000000: every batch size must be in 1.."),
    "new tokens beyond the positions": (["--max-new-tokens", "100000000"], "--max-new-tokens 100000000: must be in 1..1000"),
    "new tokens one past": (["--max-new-tokens", "1001"], "--max-new-tokens 1001: must be in 1..1000"),
    "negative new tokens": (["--max-new-tokens", "-3"], "--max-new-tokens -3: must be >= 1"),
    "negative batch size": (["--batch-sizes", "8", "-5"], "--batch-sizes 8 -5: every batch size must be >= 1"),
    "negative seed": (["--seed", "-1"], "--seed -1: must be in 0..4294967295"),
    "huge seed": (["--seed", str(2**70)], f"--seed {2**70}: must be in 0..4294967295"),
    "not an int": (["--batch-sizes", "x"], "argument --batch-sizes: invalid int value: 'x'"),
    "unknown option": (["--frobnicate"], "unrecognized arguments: --frobnicate"),
}


@pytest.mark.parametrize("argv,message", CHECK_MISMATCH.values(), ids=CHECK_MISMATCH.keys())
def test_check_mismatch_bad_sizes(argv, message, capsys, tmp_path):
    out = tmp_path / "report.json"
    _one_line_exit_2(capsys, check_mismatch.main, argv + ["--out", str(out)], message)
    assert not out.exists()


def test_check_mismatch_batch_bound_follows_the_memory(monkeypatch, capsys, tmp_path):
    """The batch-size bound is what the machine's memory allows: with 1 MiB free, 8 sequences do not fit."""
    monkeypatch.setattr(common, "available_memory", lambda: 1 << 20)
    err = _one_line_exit_2(capsys, check_mismatch.main, ["--batch-sizes", "8", "--out", str(tmp_path / "r.json")],
                           "lower --max-new-tokens")
    assert "not even one sequence fits" in err and "usable" in err
    monkeypatch.setattr(common, "available_memory", lambda: 50 << 20)
    err = _one_line_exit_2(capsys, check_mismatch.main, ["--batch-sizes", "1", "512", "--out", str(tmp_path / "r.json")],
                           "--batch-sizes 512: every batch size must be in 1..")
    assert "40 MiB is usable" in err


def _special_files(tmp_path):
    """A FIFO, a symlink to it, a symlink to a character device (never the device itself), a directory and a
    symlink to a directory: every kind of existing non-regular path a report must not replace."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to_fifo").symlink_to(fifo)
    (tmp_path / "to_devnull").symlink_to("/dev/null")
    (tmp_path / "dir").mkdir()
    (tmp_path / "to_dir").symlink_to(tmp_path / "dir")
    return {"fifo": "it is a FIFO", "to_fifo": "it is a FIFO (through a symlink)",
            "to_devnull": "it is a character device (through a symlink)", "dir": "it is a directory",
            "to_dir": "it is a directory (through a symlink)"}


@pytest.mark.parametrize("name", ["fifo", "to_fifo", "to_devnull", "dir", "to_dir"])
def test_check_mismatch_out_must_be_a_regular_file(name, capsys, tmp_path):
    kind = _special_files(tmp_path)[name]
    path = tmp_path / name
    before = os.lstat(path)
    _one_line_exit_2(capsys, check_mismatch.main, ["--batch-sizes", "1", "--max-new-tokens", "2", "--out", str(path)],
                     f"--out {path}: cannot write there ({kind})")
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)  # still the same FIFO / link / folder
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_check_mismatch_out_refused_when_it_changes_during_the_run(monkeypatch, capsys, tmp_path):
    """--out is checked again before the write: a FIFO put there while the check ran is not replaced."""
    out = tmp_path / "report.json"
    real_check = check_mismatch.check

    def check_then_plant_a_fifo(*args, **kwargs):
        rows = real_check(*args, **kwargs)
        os.mkfifo(out)
        return rows

    monkeypatch.setattr(check_mismatch, "check", check_then_plant_a_fifo)
    _one_line_exit_2(capsys, check_mismatch.main, ["--batch-sizes", "1", "--max-new-tokens", "2", "--out", str(out)],
                     "cannot write there (it is a FIFO); nothing was written")
    assert not out.is_file() and out.exists()


def test_check_mismatch_replaces_a_symlink_to_a_file_not_its_target(capsys, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text("keep me")
    link = tmp_path / "report.json"
    link.symlink_to(target)
    assert check_mismatch.main(["--batch-sizes", "1", "--max-new-tokens", "2", "--out", str(link)]) == 0
    assert target.read_text() == "keep me" and not link.is_symlink() and json.loads(link.read_text())["rows"]


# -- bisect --------------------------------------------------------------------------------------------------
BISECT = {
    "negative prompt": (["--prompt-len", "-1"], "--prompt-len -1: must be >= 1"),
    "no prompt": (["--prompt-len", "0"], "--prompt-len 0: must be >= 1"),
    "prompt beyond the positions": (["--prompt-len", "100000000"], "--prompt-len 100000000: must be in 1..2047"),
    "new tokens beyond the positions": (["--prompt-len", "8", "--new-tokens", "2041"],
                                        "--new-tokens 2041: must be in 1..2040 (--prompt-len 8 plus the new tokens"),
    "no new tokens": (["--new-tokens", "0"], "--new-tokens 0: must be >= 1"),
    "negative batch": (["--batch", "-5"], "--batch -5: must be >= 0"),
    "batch beyond the memory": (["--batch", "100000000"], "--batch 100000000: must be in 0.."),
    "negative seed": (["--seed", "-1"], "--seed -1: must be in 0.."),
    "not an int": (["--batch", "x"], "argument --batch: invalid int value: 'x'"),
    "unknown op": (["--force-fast", "softmax"], "--force-fast 'softmax' is not an op"),
    "unknown option": (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    "bad kernel set": (["--kernels", "quick"], "argument --kernels: invalid choice: 'quick'"),
}


@pytest.mark.parametrize("argv,message", BISECT.values(), ids=BISECT.keys())
def test_bisect_bad_sizes(argv, message, capsys):
    _one_line_exit_2(capsys, bisect.main, argv, message)


def test_bisect_batch_bound_follows_the_memory(monkeypatch, capsys):
    monkeypatch.setattr(common, "available_memory", lambda: 1 << 10)
    _one_line_exit_2(capsys, bisect.main, ["--batch", "0"], "not even one sequence fits")
    monkeypatch.setattr(common, "available_memory", lambda: 4 << 20)
    err = _one_line_exit_2(capsys, bisect.main, ["--batch", "1000"], "--batch 1000: must be in 0..")
    assert "usable" in err


# -- report --------------------------------------------------------------------------------------------------
GOOD = {"update": 1, "lag": 0, "reward": 0.5, "k3": 1e-3, "grad_norm": 1.0}
BAD_ROWS = {
    "not json": ("{not json", "not JSON"),
    "truncated": ('{"update": 3, "la', "not JSON"),
    "a list": ("[1, 2]", "a JSON list, not an object"),
    "no update": ('{"lag": 0}', "no 'update'"),
    "no lag": ('{"update": 2}', "no 'lag'"),
    "lag float": ('{"update": 2, "lag": 1e9}', "'lag' is 1000000000.0: expected an integer in 0..64"),
    "lag huge": ('{"update": 2, "lag": 1000000000}', "'lag' is 1000000000: expected an integer in 0..64"),
    "lag negative": ('{"update": 2, "lag": -1}', "'lag' is -1: expected an integer in 0..64"),
    "lag bool": ('{"update": 2, "lag": true}', "'lag' is True"),
    "update string": ('{"update": "2", "lag": 0}', "'update' is '2': expected an integer"),
    "reward string": ('{"update": 2, "lag": 0, "reward": "high"}', "'reward' is 'high': expected a number or null"),
    "grad norm list": ('{"update": 2, "lag": 0, "grad_norm": [1]}', "'grad_norm' is [1]"),
    "huge int": ('{"update": 2, "lag": 0, "k3": 1' + "0" * 400 + "}", "'k3' is 1000"),
    "too long": ('{"update": 2, "lag": 0, "pad": "' + "x" * (report.LINE_MAX + 10) + '"}', "longer than 1048576 characters"),
}


@pytest.mark.parametrize("line,problem", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_report_skips_a_bad_row_naming_file_and_line(line, problem, capsys, tmp_path):
    rows = [json.dumps(GOOD), line, json.dumps({**GOOD, "update": 2, "lag": 1, "k3": None, "grad_norm": float("nan")})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert report.main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert f"warning: {tmp_path / 'metrics.jsonl'}:2: skipped a bad metrics row: {problem}" in captured.err
    assert (tmp_path / "plots" / "training.png").stat().st_size > 0


def test_report_warnings_are_capped(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(GOOD) + "\n" + "junk\n" * 50)
    assert report.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == report.WARNINGS_SHOWN + 1 and "skipped 45 more bad rows" in err


def _bad_run(tmp_path, case):
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"
    if case == "only bad rows":
        metrics.write_text('{"update": 1, "lag": 1000000000}\n{"update": 2}\n')
    elif case == "not utf-8":
        metrics.write_bytes(b'{"update": 1, "lag": 0}\n{"update": 2, "lag": 0, "x": "\xff"}\n')
    elif case == "empty":
        metrics.write_text("\n\n")
    elif case == "plots is a file":
        metrics.write_text(json.dumps(GOOD) + "\n")
        (run / "plots").write_text("mine")
    elif case == "training.png is a FIFO":
        metrics.write_text(json.dumps(GOOD) + "\n")
        (run / "plots").mkdir()
        os.mkfifo(run / "plots" / "training.png")
    elif case == "training.png links to /dev/null":
        metrics.write_text(json.dumps(GOOD) + "\n")
        (run / "plots").mkdir()
        (run / "plots" / "training.png").symlink_to("/dev/null")
    elif case == "no metrics":
        metrics.mkdir()
    return run


REPORT_ERRORS = {
    "only bad rows": ("metrics.jsonl holds no plottable metrics row (2 bad; line 1: 'lag' is 1000000000"),
    "not utf-8": ("metrics.jsonl is not UTF-8 text"),
    "empty": ("metrics.jsonl holds no plottable metrics row (0 bad)"),
    "plots is a file": ("plots: something that is not a folder is in the way"),
    "training.png is a FIFO": ("training.png (it is a FIFO); move it away"),
    "training.png links to /dev/null": ("training.png (it is a character device (through a symlink))"),
    "no metrics": ("metrics.jsonl not found"),
}


@pytest.mark.parametrize("case,message", REPORT_ERRORS.items(), ids=REPORT_ERRORS.keys())
def test_report_errors_name_the_file(case, message, capsys, tmp_path):
    run = _bad_run(tmp_path, case)
    before = {p: os.lstat(p) for p in run.rglob("*")}
    err = _one_line_exit_2(capsys, report.main, [str(run)], message)
    assert str(run) in err
    after = {p: os.lstat(p) for p in run.rglob("*")}
    assert {p: (s.st_ino, s.st_mode) for p, s in after.items()} == {p: (s.st_ino, s.st_mode) for p, s in before.items()}


def test_report_bad_summary_is_a_warning(capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({**GOOD, "heldout_pass_at_1": 0.5}) + "\n")
    for text, problem in [("{broken", "cannot read it (JSONDecodeError)"), ("[1]", None),
                          ('{"heldout_pass_at_1_start": "x"}', "heldout_pass_at_1_start 'x': expected a finite number")]:
        (tmp_path / "summary.json").write_text(text)
        assert report.main([str(tmp_path)]) == 0
        err = capsys.readouterr().err
        assert (f"warning: {tmp_path / 'summary.json'}: ignored" in err and problem in err) if problem else err == ""


def test_report_refuses_a_metrics_file_too_large_for_the_memory(monkeypatch, capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(GOOD) + "\n" * 2000)
    monkeypatch.setattr(common, "available_memory", lambda: 10_000)
    _one_line_exit_2(capsys, report.main, [str(tmp_path)], f"{tmp_path / 'metrics.jsonl'} is 2.02 KiB: too large to plot")
    assert not (tmp_path / "plots").exists()


def test_report_keeps_the_old_plot_when_saving_fails(monkeypatch, capsys, tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "training.png").write_bytes(b"old plot")
    import matplotlib.figure

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    _one_line_exit_2(capsys, report.main, [str(tmp_path)], f"cannot write {tmp_path / 'plots' / 'training.png'}: No space")
    assert (tmp_path / "plots" / "training.png").read_bytes() == b"old plot"
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["training.png"]  # no temporary file left


@pytest.mark.parametrize("argv,message", [([], "the following arguments are required: run_dir"),
                                          (["a", "b"], "unrecognized arguments: b")])
def test_report_bad_arguments(argv, message, capsys):
    _one_line_exit_2(capsys, report.main, argv, message)


# -- convert -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    ([], "the following arguments are required: gguf, out"),
    (["x.gguf", "out", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
    (["x.bin", "out"], "x.bin: not a .gguf file"),
])
def test_convert_bad_arguments(argv, message, capsys):
    _one_line_exit_2(capsys, convert.main, argv, message)


@pytest.mark.parametrize("tool,argv", [("report", []), ("bisect", ["--batch", "-5"])])
def test_tools_as_commands_exit_2_with_one_line(tool, argv, tmp_path):
    out = subprocess.run([sys.executable, "-m", f"nemo_rz.tools.{tool}", *argv], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
