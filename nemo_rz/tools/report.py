"""`python -m nemo_rz.tools.report RUN_DIR`: PNG plots of a run's metrics.jsonl into RUN_DIR/plots/."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

from nemo_rz import atomic
from nemo_rz.errors import ArgumentParser
from nemo_rz.tools.common import fail, human_bytes, regular_file_problem, usable_memory

PANELS = [
    ("reward", "reward (train batch mean)"),
    ("heldout_pass_at_1", "held-out pass@1 (greedy)"),
    ("k3", "k3 KL rollout -> learner"),
    ("is_dev", "importance-weight deviation mean|rho-1|"),
    ("grad_norm", "grad norm before clipping"),
    ("rollout_tokens_per_s", "tokens/s (rollout, learner)"),
]


LAG_MAX = 64  # algo.max_lag's largest value: a run never records a larger lag (and the histogram has a bin per lag)
LINE_MAX = 1 << 20  # characters of one metrics row; a longer line is not a row nemo_rz.train wrote
WARNINGS_SHOWN = 5
ROW_MEMORY_FACTOR = 8  # bytes of parsed rows (dicts of floats) per byte of metrics.jsonl, generously


UPDATE_MAX = 10**9


def _is_number(v, finite: bool = True) -> bool:
    """A JSON number a plot can take: a float (finite, unless finite=False) or an int within float range."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    if isinstance(v, int):
        return abs(v) <= 1e300
    return not finite or math.isfinite(v)


def row_problem(row) -> str | None:
    """Why a parsed metrics row cannot be plotted (None: it can): it must be an object with an integer
    `update` >= 0, an integer `lag` in 0..LAG_MAX, and numbers (NaN and infinities are gaps in a plot) or null
    (not measured) for the plotted keys it has."""
    if not isinstance(row, dict):
        return f"a JSON {type(row).__name__}, not an object"
    for key, hi in (("update", UPDATE_MAX), ("lag", LAG_MAX)):
        v = row.get(key)
        if key not in row:
            return f"no {key!r}"
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            return f"{key!r} is {_shown(v)}: expected an integer in 0..{hi}"
    for key in PLOTTED:
        if row.get(key) is not None and not _is_number(row[key], finite=False):
            return f"{key!r} is {_shown(row[key])}: expected a number or null"
    return None


def _shown(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "..."


def load_metrics(run_dir: Path, warn=None) -> list[dict]:
    """The plottable rows of RUN_DIR/metrics.jsonl. A bad row (not JSON, missing or mistyped keys, a lag
    out of range: a truncated last line after a crash, a hand edit) is skipped with one warning line naming
    the file and line number (warn(message); default stderr). Raises ValueError naming the file when it
    cannot be read or holds no plottable row."""
    path = Path(run_dir) / "metrics.jsonl"
    if warn is None:
        warn = lambda message: print(f"warning: {message}", file=sys.stderr)  # noqa: E731
    if not path.is_file():
        raise ValueError(f"{path} not found: give a run directory written by nemo_rz.train")
    rows, skipped = [], []
    try:
        size = path.stat().st_size
        if size * ROW_MEMORY_FACTOR > usable_memory():  # the parsed rows take several times the text
            raise ValueError(f"{path} is {human_bytes(size)}: too large to plot with the {human_bytes(usable_memory())} "
                             "of memory usable here; plot a copy holding the rows you need")
        with open(path, encoding="utf-8", errors="strict", newline="") as f:
            lineno = 0
            while True:
                line = f.readline(LINE_MAX + 1)
                if not line:
                    break
                lineno += 1
                if len(line) > LINE_MAX and not line.endswith("\n"):
                    while line and not line.endswith("\n"):  # the rest of the over-long line
                        line = f.readline(LINE_MAX)
                    skipped.append((lineno, f"longer than {LINE_MAX} characters"))
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, RecursionError) as e:
                    skipped.append((lineno, f"not JSON ({getattr(e, 'msg', 'nested too deeply')})"))
                    continue
                problem = row_problem(row)
                if problem:
                    skipped.append((lineno, problem))
                else:
                    rows.append({k: v for k, v in row.items() if v is not None})  # null: not measured
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}; check the file and its permissions") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text (byte {e.start} of a line): not a metrics file nemo_rz.train wrote") from None
    if not rows:
        first = f"; line {skipped[0][0]}: {skipped[0][1]}" if skipped else ""
        raise ValueError(f"{path} holds no plottable metrics row ({len(skipped)} bad{first}): give a run directory "
                         "written by nemo_rz.train")
    for lineno, problem in skipped[:WARNINGS_SHOWN]:
        warn(f"{path}:{lineno}: skipped a bad metrics row: {problem}")
    if len(skipped) > WARNINGS_SHOWN:
        warn(f"{path}: skipped {len(skipped) - WARNINGS_SHOWN} more bad rows (not listed)")
    return rows


def _start_pass_at_1(run_dir: Path, warn) -> float | None:
    """summary.json's held-out pass@1 before training, or None (absent, or unusable: with a warning)."""
    summary = Path(run_dir) / "summary.json"
    if not summary.is_file():
        return None
    try:
        data = json.loads(summary.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        warn(f"{summary}: ignored, cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})")
        return None
    start = data.get("heldout_pass_at_1_start") if isinstance(data, dict) else None
    if start is not None and not _is_number(start):
        warn(f"{summary}: ignored heldout_pass_at_1_start {_shown(start)}: expected a finite number")
        return None
    return start


def _save(plt, fig, path: Path) -> Path:
    """fig as PNG at `path`, written beside it and renamed into place (an existing regular file is replaced only
    when the new one is complete; anything else at `path` is refused), then closed; a failure is one ValueError."""
    try:
        _write_png(fig, path)
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}; check the folder is writable and has space") from None
    finally:
        plt.close(fig)
    return path


def _write_png(fig, path: Path) -> None:
    problem = regular_file_problem(str(path))
    if problem:
        raise ValueError(f"cannot write {path} ({problem}); move it away and rerun")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, dpi=80, format="png")
        os.chmod(tmp, 0o666 & ~atomic.umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_plots(run_dir: Path, warn=None) -> list[Path]:
    """plots/training.png (and plots/speculative.png for a run with a draft) of RUN_DIR's metrics. Raises
    ValueError, naming the file, for input it cannot use or a place it cannot write."""
    if warn is None:
        warn = lambda message: print(f"warning: {message}", file=sys.stderr)  # noqa: E731
    rows = load_metrics(run_dir, warn)
    start = _start_pass_at_1(run_dir, warn)
    out_dir = Path(run_dir) / "plots"
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"cannot create {out_dir}: something that is not a folder is in the way; move it away and rerun")
    try:
        out_dir.mkdir(exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {out_dir}: {e.strerror or e}; check the run directory is writable") from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (key, title) in zip(axes.flat, PANELS):
        pts = [(r["update"], r[key]) for r in rows if key in r]
        if key == "heldout_pass_at_1" and start is not None and rows and rows[0]["update"] == 1:
            pts = [(0, start)] + pts  # the evaluation before the first update
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=key.split("_")[0])
        if key == "rollout_tokens_per_s":
            pts = [(r["update"], r["learner_tokens_per_s"]) for r in rows if "learner_tokens_per_s" in r]
            if pts:
                ax.plot(*zip(*pts), label="learner")
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        if key in ("k3", "is_dev") and pts and min(v for _, v in pts) > 0:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("update")
    lags = [r["lag"] for r in rows]  # integers in 0..LAG_MAX (row_problem): at most LAG_MAX + 1 bins
    ax = axes.flat[6]
    if lags:
        ax.hist(lags, bins=range(0, min(max(lags), LAG_MAX) + 2), align="left", rwidth=0.8)
    ax.set_title("policy lag histogram")
    ax.set_xlabel("lag (updates)")
    ax = axes.flat[7]
    pts = [(r["update"], r["kernel_diff_tokens"]) for r in rows if "kernel_diff_tokens" in r]
    if pts:
        ax.plot(*zip(*pts), marker="o", label="kernel_diff_tokens")
    pts = [(r["update"], r["routing_diff_tokens"]) for r in rows if "routing_diff_tokens" in r]
    if pts:
        ax.plot(*zip(*pts), marker="x", label="routing_diff_tokens")
        ax.legend()
    ax.set_title("kernel mismatch tokens (0 = bit-identical)")
    ax.set_xlabel("update")
    fig.tight_layout()
    paths = [_save(plt, fig, out_dir / "training.png")]
    if any("draft_loss" in r for r in rows):
        paths.append(_draft_plots(plt, rows, out_dir))
    return paths


DRAFT_PANELS = [  # (title, [(key, legend)]): the learner's estimate on the RL batch beside the engine's count
    ("draft loss (mean over training-time-test steps)", [("draft_loss", None)]),
    ("draft acceptance rate", [("draft_accept_rate", "estimated on the batch"), ("spec_accept_rate", "rollout engine")]),
    ("tokens per target pass", [("draft_tokens_per_pass", "estimated on the batch"), ("spec_tokens_per_pass", "rollout engine")]),
    ("rollout tokens/s (speculative)", [("rollout_tokens_per_s", None)]),
]


def _draft_plots(plt, rows: list[dict], out_dir: Path) -> Path:
    """The draft's numbers per update (draft.mode=cotrain or frozen)."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, (title, lines) in zip(axes.flat, DRAFT_PANELS):
        for key, legend in lines:
            pts = [(r["update"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=legend)
        if any(legend for _, legend in lines) and ax.get_legend_handles_labels()[0]:
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("update")
    fig.tight_layout()
    return _save(plt, fig, out_dir / "speculative.png")


# every key a panel plots: row_problem checks each one a row has is a finite number
PLOTTED = tuple(dict.fromkeys([key for key, _ in PANELS] + ["learner_tokens_per_s", "kernel_diff_tokens", "routing_diff_tokens"]
                              + [key for _, lines in DRAFT_PANELS for key, _ in lines]))


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m nemo_rz.tools.report", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    try:
        args = ap.parse_args(argv)
        paths = write_plots(Path(args.run_dir))
    except ValueError as e:
        fail(str(e))
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
