"""The README's examples run as written."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_nemo_rl_loss_example():
    out = _run("examples/nemo_rl_loss.py")
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("full batch loss "))
    full, summed = [float(x) for x in line.removeprefix("full batch loss ").split(" = sum of microbatch losses ")]
    assert full == pytest.approx(summed, abs=1e-6) and full != 0.0
    assert "is_dev 0 " in out.stdout


def test_bring_your_own_hf_model_example():
    pytest.importorskip("transformers")
    out = _run("examples/bring_your_own_hf_model.py")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count(": 0 of ") == 2


def test_report_tool_rejects_a_non_run_directory(tmp_path):
    out = _run("-m", "nemo_rz.tools.report", str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("error:") and "metrics.jsonl not found" in out.stderr
