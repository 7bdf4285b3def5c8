"""The command line takes `--config` and `key=value` overrides in any order, and `run_dir=` never writes into a
folder that is not a run."""
import pytest
from test_cli_errors import TINY

from nemo_rz import train


def test_options_and_overrides_intermixed(tmp_path, capsys):
    """`--config` between overrides, and after them, reads as it does before them."""
    (tmp_path / "lag.yaml").write_text("algo:\n  max_lag: 1\n")
    for i, order in enumerate((
        [f"--config={tmp_path / 'lag.yaml'}", "algo.updates=1"],
        ["algo.updates=1", "--config", str(tmp_path / "lag.yaml")],
        ["eval.n=8", "--config", str(tmp_path / "lag.yaml"), "algo.updates=1"],
    )):
        args = train._args(TINY + order)
        assert args.config == str(tmp_path / "lag.yaml") and "algo.updates=1" in args.overrides
        cfg = train.config_lib.load(args.config, args.overrides)
        assert (cfg.algo.max_lag, cfg.algo.updates) == (1, 1), order
    run_dir = tmp_path / "run"
    assert train.main([f"run_dir={run_dir}", "--config", str(tmp_path / "lag.yaml"), *TINY, "algo.updates=1"]) == 0
    assert "max_lag: 1" in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("contents", ["notes.txt", "sub/", "link"])
def test_run_dir_not_a_run_is_refused(tmp_path, capsys, contents):
    """A non-empty folder that holds no run (`run_dir=.` or `$HOME`) is refused before anything is written."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "settings.yaml").write_text("precious: true\n")
    if contents == "sub/":
        (folder / "sub").mkdir()
    elif contents == "link":
        (folder / "link").symlink_to(tmp_path)
    else:
        (folder / contents).write_text("keep me")
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}
    assert train.main(TINY + [f"run_dir={folder}", "algo.updates=1"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: run_dir {folder} is a folder with other files in it, not a run; choose a new or empty run_dir\n"
    assert {p: p.read_bytes() for p in before} == before and not (folder / "plots").exists()


def test_run_dir_empty_folder_is_used(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert train.main(TINY + [f"run_dir={folder}", "algo.updates=1"]) == 0
    assert (folder / "summary.json").exists()



def test_summary_is_strict_json(tmp_path, monkeypatch):
    """A figure with no finite value (is_dev peak over a median of 0) is null in summary.json, never Infinity."""
    import json

    import nemo_rz.runtime.trainer as trainer_module

    real = trainer_module.Trainer.run

    def run(self, progress=None):
        summary = real(self, progress)
        return {**summary, "is_dev_peak_over_median": float("inf")}

    monkeypatch.setattr(trainer_module.Trainer, "run", run)
    assert train.main(TINY + [f"run_dir={tmp_path / 'r'}", "algo.updates=1"]) == 0
    text = (tmp_path / "r" / "summary.json").read_text()
    assert "Infinity" not in text and json.loads(text)["is_dev_peak_over_median"] is None


def test_a_run_that_stopped_before_its_first_update_is_a_run(tmp_path, capsys):
    """A run directory holding only config.yaml (it stopped while starting) is refused as a run, with resume= named."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 0\n")
    assert train.main(TINY + [f"run_dir={run_dir}", "algo.updates=1"]) == 2
    assert f"already holds a run; pass resume={run_dir}" in capsys.readouterr().err
