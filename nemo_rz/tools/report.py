"""`python -m nemo_rz.tools.report RUN_DIR`: PNG plots of a run's metrics.jsonl into RUN_DIR/plots/."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = [
    ("reward", "reward (train batch mean)"),
    ("heldout_pass_at_1", "held-out pass@1 (greedy)"),
    ("k3", "k3 KL rollout -> learner"),
    ("is_dev", "importance-weight deviation mean|rho-1|"),
    ("grad_norm", "grad norm before clipping"),
    ("rollout_tokens_per_s", "tokens/s (rollout, learner)"),
]


def load_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: give a run directory written by nemo_rz.train")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_plots(run_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(exist_ok=True)
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    summary = Path(run_dir) / "summary.json"
    start = json.loads(summary.read_text()).get("heldout_pass_at_1_start") if summary.is_file() else None
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
            ax.legend()
        if key in ("k3", "is_dev") and pts and min(v for _, v in pts) > 0:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("update")
    lags = [r["lag"] for r in rows]
    ax = axes.flat[6]
    if lags:
        ax.hist(lags, bins=range(0, max(lags) + 2), align="left", rwidth=0.8)
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
    path = out_dir / "training.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths = [path]
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
        if any(legend for _, legend in lines):
            ax.legend()
        ax.set_title(title)
        ax.set_xlabel("update")
    fig.tight_layout()
    path = out_dir / "speculative.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_rz.tools.report", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    args = ap.parse_args(argv)
    try:
        paths = write_plots(Path(args.run_dir))
    except ValueError as e:
        print(f"error: {e}", file=__import__("sys").stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
