"""The wheel carries the default config and presets: `python -m nemo_rz.train` runs from any folder.

The wheel is built from a copy of the source tree (no stale build/ output), installed with --no-deps into a
fresh virtual environment that reuses this interpreter's packages (torch...) through a .pth file,
and a 2-update job runs from an empty temporary folder. The package must come from the venv, not this
checkout. Negative control: the same install without its packaged conf/ fails to start.
"""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import venv_over_this

ROOT = Path(__file__).resolve().parent.parent
JOB = ["task.name=add1", "warmup.steps=5", "algo.updates=2", "algo.prompts_per_update=2", "algo.group_size=2",
       "eval.n=4", "progress=false", "metrics.tensorboard=false", "checkpoint.every=0", "run_dir=run"]


def _wheel(src: Path, out: Path) -> Path:
    shutil.rmtree(src / "build", ignore_errors=True)  # setuptools would pack stale files from an earlier build
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
                   check=True, capture_output=True, text=True)
    return next(out.glob("nemo_rz-*.whl"))


def _venv(path: Path, wheel: Path) -> Path:
    python = venv_over_this(path, with_checkout=False)  # the checkout's editable install stays off the path
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, text=True)
    return python


def _train(python: Path, cwd: Path) -> subprocess.CompletedProcess:
    # The checkout's editable install must not shadow the wheel: keep it off the path.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), "-m", "nemo_rz.train", *JOB], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the source tree, built once: each test installs it into a virtual environment of
    its own."""
    src = tmp_path_factory.mktemp("src") / "nemo-rz"
    anywhere = shutil.ignore_patterns(".git", "runs", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")

    def ignore(folder, names):  # and, at the top only, the checkout's virtual environment and models (gigabytes)
        return anywhere(folder, names) | ({".venv", "models"} & set(names) if Path(folder) == ROOT else set())

    shutil.copytree(ROOT, src, ignore=ignore)
    return _wheel(src, tmp_path_factory.mktemp("dist"))


def test_wheel_runs_from_any_folder(wheel, tmp_path):
    python = _venv(tmp_path / "venv", wheel)
    where = subprocess.run([str(python), "-c", "import nemo_rz.config as c; print(c.__file__); print(c.DEFAULT)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert all(p.startswith(str(tmp_path / "venv")) for p in where), where   # the wheel's copy, not the checkout
    assert Path(where[1]).is_file()
    work = tmp_path / "elsewhere"
    work.mkdir()
    out = _train(python, work)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads((work / "run" / "summary.json").read_text())["updates"] == 2


def test_negative_control_wheel_without_conf(wheel, tmp_path):
    """The same wheel with its packaged config removed from the install fails to start, naming the file."""
    assert any(n.startswith("nemo_rz/kernels/") for n in zipfile.ZipFile(wheel).namelist())  # the Triton kernels ship too
    python = _venv(tmp_path / "venv", wheel)
    conf = subprocess.run([str(python), "-c", "import nemo_rz.config as c, pathlib; print(pathlib.Path(c.DEFAULT).parent)"],
                          cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert conf.startswith(str(tmp_path / "venv"))
    shutil.rmtree(conf)
    out = _train(python, tmp_path)
    assert out.returncode != 0 and "default.yaml" in out.stderr
