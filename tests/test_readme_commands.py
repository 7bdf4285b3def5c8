"""CI runs the README's two commands as a new user would: the install command (up to running the main job) in a
fresh virtual environment, then the test command with that environment's pytest; and the README's reading guide
names files the reference step's imports reach."""
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


def _imports(path: Path) -> set[Path]:
    """The project files `path` imports (module or package), by file."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names += [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if not name.startswith("nemo_rz"):
                continue
            base = ROOT / Path(*name.split("."))
            for f in (base.with_suffix(".py"), base / "__init__.py"):
                if f.is_file():
                    found.add(f)
    return found


def _reached(start: Path) -> set[Path]:
    seen, todo = set(), [start]
    while todo:
        f = todo.pop()
        if f not in seen:
            seen.add(f)
            todo.extend(_imports(f))
    return seen


def _guide(text: str) -> list[Path]:
    section = text[text.index("## How it works"):text.index("## Three ways to use it")]
    block = re.search(r"```\n(.*?)\n```", section, flags=re.S).group(1)
    return [ROOT / line.split()[0] for line in block.splitlines() if line.strip()]


def test_reading_guide_follows_the_imports():
    files = _guide((ROOT / "README.md").read_text())
    assert files[0] == ROOT / "nemo_rz/runtime/reference.py" and all(f.is_file() for f in files)
    reached = _reached(files[0])
    assert [f for f in files if f not in reached] == []
    # negative control: a file the reference step never reaches is found
    assert ROOT / "nemo_rz/tools/report.py" not in reached
