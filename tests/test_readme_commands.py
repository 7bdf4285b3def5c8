"""CI runs the README's two commands as a new user would: the install command (up to running the main job) in a
fresh virtual environment, then the test command with that environment's pytest."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands(text: str) -> tuple[list[str], str]:
    blocks = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    install, tests = blocks[0], blocks[1]
    steps = [s.strip() for s in install.split("&&")]
    assert steps[-1] == "python -m nemo_rz.train", steps  # the main job on its embedded default
    return steps[:-1], tests.strip()


def _ci_runs(steps: list[str], test: str, ci: str) -> list[str]:
    """The README steps CI does not run the same way (pip's --quiet aside)."""
    lines = [line.replace(" --quiet", "") for line in ci.splitlines() if not line.lstrip().startswith("#")]
    body = "\n".join(lines)
    missing = [s for s in steps if s not in body]
    if test not in lines:
        missing.append(test)
    return missing


def test_ci_runs_the_readme_commands_in_a_fresh_venv():
    steps, test = _readme_commands((ROOT / "README.md").read_text())
    ci = (ROOT / ".ci" / "run").read_text()
    assert steps[0].startswith("python3 -m venv ") and ". .venv/bin/activate" in steps
    assert "rm -rf .venv" in ci  # fresh, whatever a previous run left
    assert _ci_runs(steps, test, ci) == []
    # negative control: a README step CI skips is found
    assert _ci_runs(steps + ["pip install scipy"], test, ci) == ["pip install scipy"]
    assert _ci_runs(steps, test, ci.replace("pytest -q", "python -m pytest -q tests/test_ops.py")) == [test]
