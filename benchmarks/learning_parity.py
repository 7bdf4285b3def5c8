"""Learning parity: REINFORCE Zero's published comparison table (sync vs lag 2/8/64 vs standard kernels
with IS and gates) at CPU scale, on the default task.

Rows, all with the same update budget, seed(s), task (add2), model, batch and warm-up (the defaults of
conf/default.yaml unless overridden after `--`):

  sync            algo.max_lag=0, consistent kernels, unclipped IS (IS is exactly 1: no lag, no mismatch)
  rz-lag2/8/64    REINFORCE Zero: consistent kernels on both sides, unclipped token IS, max_lag 2 / 8 / 64
  std-lag8-<c>    standard kernels: rollout runtime.rollout_kernels=fast runtime.rollout_dtype=bfloat16, learner
                  fp32 consistent, max_lag 8, algo.correction = unclipped | seq_gate | token_mask | cis

Columns: held-out greedy pass@1 at the start (after warm-up) and at the end (eval.n problems); max grad norm
before clipping; median k3 KL (rollout -> learner) over the first and the last --window fraction of updates and
their ratio; is_dev = mean|rho - 1| peak / median over the run; rejection rate (mean over the last window);
from the decomposition rows: kernel_diff_tokens (sum; 0 means bit-identical logprobs) and median kernel_k3.
A run that stops with an error (e.g. a non-finite importance weight) is reported as such, with the update.

Each run is a fresh child process that builds `Trainer` in-process. The supervised warm-up depends only on the
seed and the model/warm-up settings, so the first run of a seed saves its warm-up weights and later runs with
the same seed load them instead of repeating the 400 steps (identical weights: the start pass@1 is printed per
row as a check).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
        python benchmarks/learning_parity.py --updates 300 --seeds 0
    python benchmarks/learning_parity.py --quick          # smoke run, < 2 minutes
    python benchmarks/learning_parity.py --rows sync,rz-lag8 --seeds 0,1 -- algo.lr=0.0005
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296", "MALLOC_TOP_PAD_": "268435456"}
STD = ["runtime.rollout_kernels=fast", "runtime.rollout_dtype=bfloat16", "kernels=consistent", "algo.max_lag=8"]
ROWS = {
    "sync": ["algo.max_lag=0", "algo.correction=unclipped"],
    "rz-lag2": ["algo.max_lag=2", "algo.correction=unclipped"],
    "rz-lag8": ["algo.max_lag=8", "algo.correction=unclipped"],
    "rz-lag64": ["algo.max_lag=64", "algo.correction=unclipped"],
    "std-lag8-unclipped": [*STD, "algo.correction=unclipped"],
    "std-lag8-seq_gate": [*STD, "algo.correction=seq_gate"],
    "std-lag8-token_mask": [*STD, "algo.correction=token_mask"],
    "std-lag8-cis": [*STD, "algo.correction=cis"],
}
QUICK_ROWS = "sync,rz-lag8,std-lag8-unclipped"
COMMON = ["checkpoint.every=0", "metrics.tensorboard=false", "progress=false", "metrics.decomposition_every=10"]


# -- child: one run ------------------------------------------------------------------------------------
def child(run_dir: str, cache_dir: str, overrides: list[str], config_file: str | None = None) -> None:
    import torch

    from nemo_rz import config
    from nemo_rz.errors import DivergenceError
    from nemo_rz.runtime.trainer import Trainer

    cfg = config.load(config_file, overrides)
    cfg.run_dir = run_dir
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    # The warm-up depends on seed, model, task and warm-up settings only.
    from omegaconf import OmegaConf

    key = json.dumps([cfg.seed, cfg.kernels, *(OmegaConf.to_container(cfg[k]) for k in ("model", "task", "warmup"))],
                     sort_keys=True, default=str)
    cache = Path(cache_dir) / f"warmup-{hashlib.sha1(key.encode()).hexdigest()[:12]}.pt"

    class CachedWarmupTrainer(Trainer):
        def _warmup(self):
            if cfg.warmup.steps == 0:  # a pretrained model (e.g. conf/smollm2_arith.yaml): nothing to cache
                return super()._warmup()
            if cache.is_file():
                self.model.load_state_dict(torch.load(cache))
                self.log(f"warm-up: loaded {cache}")
                return
            super()._warmup()
            tmp = cache.with_suffix(".tmp")
            torch.save(self.model.state_dict(), tmp)
            os.replace(tmp, cache)

    status = {"ok": True}
    trainer = CachedWarmupTrainer(cfg, Path(run_dir), log=lambda *a: None)
    try:
        summary = trainer.run()
    except (DivergenceError, ValueError, RuntimeError) as e:
        status = {"ok": False, "error": f"{type(e).__name__}: {e}", "at_update": trainer.version}
        summary = {"updates": trainer.version, "max_grad_norm": trainer.max_grad_norm,
                   "is_dev_peak_over_median": trainer.is_dev.ratio,
                   "heldout_pass_at_1_start": trainer.heldout.history[0][1], "heldout_pass_at_1_end": float("nan")}
    summary["status"] = status
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))


# -- parent: run rows, summarise -----------------------------------------------------------------------
def _median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else float("nan")


def summarise(rows: list[dict], summary: dict, window: float) -> dict:
    n = len(rows)
    w = max(1, int(round(window * n)))
    first, last = rows[:w], rows[-w:]
    k3_first, k3_last = _median(r["k3"] for r in first), _median(r["k3"] for r in last)
    if k3_first > 0:
        k3_ratio = k3_last / k3_first
    else:
        k3_ratio = float("nan") if k3_last > 0 else 1.0  # both zero: flat
    dec = [r for r in rows if "kernel_diff_tokens" in r]
    return dict(
        updates=n, status=summary.get("status", {"ok": True}),
        pass_start=summary["heldout_pass_at_1_start"], pass_end=summary["heldout_pass_at_1_end"],
        max_grad_norm=summary["max_grad_norm"], k3_first=k3_first, k3_last=k3_last, k3_ratio=k3_ratio,
        is_dev_peak_over_median=summary["is_dev_peak_over_median"],
        rejection_last=statistics.mean(r["rejection_rate"] for r in last) if n else float("nan"),
        reward_first=statistics.mean(r["reward"] for r in first) if n else float("nan"),
        reward_last=statistics.mean(r["reward"] for r in last) if n else float("nan"),
        kernel_diff_tokens=sum(r["kernel_diff_tokens"] for r in dec),
        kernel_k3=_median(r["kernel_k3"] for r in dec), lag_k3=_median(r["lag_k3"] for r in dec),
        seconds=rows[-1]["elapsed_s"] if rows else float("nan"),
        curves=dict(
            update=[r["update"] for r in rows], k3=[r["k3"] for r in rows], is_dev=[r["is_dev"] for r in rows],
            reward=[r["reward"] for r in rows],
            heldout=[(0, summary["heldout_pass_at_1_start"])]
            + [(r["update"], r["heldout_pass_at_1"]) for r in rows if "heldout_pass_at_1" in r],
        ),
    )


def fmt(x, spec=".3f"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, spec)


def mean_sd(xs, spec=".3f", scale=1.0):
    xs = [x * scale for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return format(xs[0], spec)
    return f"{format(statistics.mean(xs), spec)} ± {format(statistics.stdev(xs), spec)}"


def table(results: dict[str, list[dict]]) -> str:
    head = ("| row | seeds | held-out pass@1 start -> end | max grad norm | k3 median first -> last window | k3 last/first | "
            "is_dev peak/median | rejection rate (last window) | kernel diff tokens | kernel_k3 median | status |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, runs in results.items():
        bad = [r for r in runs if not r["status"]["ok"]]
        status = "ok" if not bad else "; ".join(f"stopped at update {r['status']['at_update']}: {r['status']['error'][:90]}" for r in bad)
        lines.append(
            f"| {name} | {len(runs)} | {mean_sd([r['pass_start'] for r in runs])} -> {mean_sd([r['pass_end'] for r in runs])} | "
            f"{fmt(max(r['max_grad_norm'] for r in runs), '.3g')} | "
            f"{fmt(_median(r['k3_first'] for r in runs), '.2e')} -> {fmt(_median(r['k3_last'] for r in runs), '.2e')} | "
            f"{fmt(_median(r['k3_ratio'] for r in runs), '.2f')}x | "
            f"{fmt(_median(r['is_dev_peak_over_median'] for r in runs), '.2f')}x | "
            f"{mean_sd([r['rejection_last'] for r in runs], '.1f', 100)}% | "
            f"{sum(r['kernel_diff_tokens'] for r in runs)} | {fmt(_median(r['kernel_k3'] for r in runs), '.2e')} | {status} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    colors = plt.get_cmap("tab10")
    for i, (name, runs) in enumerate(results.items()):
        c = colors(i % 10)
        style = "--" if name.startswith("std") else "-"
        # held-out pass@1: mean over seeds at the shared eval points
        pts = {}
        for r in runs:
            for u, v in r["curves"]["heldout"]:
                pts.setdefault(u, []).append(v)
        xs = sorted(pts)
        axes[0].plot(xs, [statistics.mean(pts[u]) for u in xs], style, marker="o", ms=3, color=c, label=name)
        for key, ax in (("k3", axes[1]), ("is_dev", axes[2])):
            n = min(len(r["curves"][key]) for r in runs)
            if n == 0:
                continue
            y = np.mean([r["curves"][key][:n] for r in runs], axis=0)
            k = max(1, n // 40)  # moving average for readability
            y = np.convolve(y, np.ones(k) / k, mode="valid")
            x = np.array(runs[0]["curves"]["update"][:n])[k - 1:]
            y = np.where(y > 0, y, np.nan)  # log scale: the sync row is exactly 0 (not drawn)
            ax.plot(x, y, style, color=c, label=name)
    axes[0].set_title("held-out greedy pass@1 (mean over seeds)")
    axes[1].set_title("k3 KL rollout -> learner (moving average; 0 not drawn)")
    axes[2].set_title("is_dev = mean|rho - 1| (moving average)")
    for ax in axes:
        ax.set_xlabel("update")
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        if len(argv) > 4 and argv[3] == "--config":
            child(argv[1], argv[2], argv[5:], config_file=argv[4])
        else:
            child(argv[1], argv[2], argv[3:])
        return 0
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=300, help="update budget, the same for every row")
    ap.add_argument("--seeds", default="0", help="comma list of seeds")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list from: {', '.join(ROWS)}")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out eval period (default: updates / 10)")
    ap.add_argument("--eval-n", type=int, default=500, help="held-out problems per eval (add2 holds out 500)")
    ap.add_argument("--window", type=float, default=0.2, help="first/last window as a fraction of the updates")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: 40 updates, rows {QUICK_ROWS}, seed 0")
    ap.add_argument("--out", default="benchmarks/plots/learning_parity.json")
    ap.add_argument("--plot", default="benchmarks/plots/learning_parity.png")
    ap.add_argument("--work-dir", default=None, help="where run directories go (default: a new temp dir)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse finished runs in --work-dir that had the same overrides (add seeds or rows later)")
    args = ap.parse_args(argv)
    if args.quick:
        args.updates, args.rows, args.seeds = 40, QUICK_ROWS, "0"
        if args.out == ap.get_default("out"):
            args.out = "benchmarks/plots/learning_parity_quick.json"
        if args.plot == ap.get_default("plot"):
            args.plot = "benchmarks/plots/learning_parity_quick.png"
    rows = args.rows.split(",")
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    every = args.eval_every or max(1, args.updates // 10)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="learning_parity-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ}
    for k, v in MALLOC.items():
        env.setdefault(k, v)
    import nemo_rz

    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {platform.node()}  cpus={os.cpu_count()}  "
          f"load={os.getloadavg()}  nemo_rz from {Path(nemo_rz.__file__).parent}  runs under {work}")
    print(f"# updates={args.updates} seeds={seeds} eval every {every} on {args.eval_n} held-out  extra: {' '.join(extra)}")
    results: dict[str, list[dict]] = {r: [] for r in rows}
    t_all = time.time()
    for seed in seeds:
        for name in rows:
            run_dir = work / f"{name}-seed{seed}"
            overrides = [*COMMON, f"algo.updates={args.updates}", f"seed={seed}", f"eval.every={every}",
                         f"eval.n={args.eval_n}", *ROWS[name], *extra]
            load = os.getloadavg()[0]
            start = time.time()
            marker = run_dir / "overrides.json"
            if args.reuse and marker.is_file() and json.loads(marker.read_text()) == overrides and (run_dir / "summary.json").is_file():
                print(f"  (reusing finished run {run_dir})")
            else:
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                proc = subprocess.run([sys.executable, __file__, "--child", str(run_dir), str(work), *overrides], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                if proc.returncode != 0 or not (run_dir / "summary.json").is_file():
                    raise SystemExit(f"run {name} seed {seed} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
                marker.write_text(json.dumps(overrides))
            summary = json.loads((run_dir / "summary.json").read_text())
            mrows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
                if (run_dir / "metrics.jsonl").is_file() else []
            s = summarise(mrows, summary, args.window)
            s.update(seed=seed, wall_s=time.time() - start, load_before=load)
            results[name].append(s)
            print(f"  {name:22s} seed {seed}: pass@1 {s['pass_start']:.3f} -> {fmt(s['pass_end'])}  "
                  f"max|g| {s['max_grad_norm']:.3g}  k3 {fmt(s['k3_first'], '.1e')} -> {fmt(s['k3_last'], '.1e')}  "
                  f"is_dev p/m {fmt(s['is_dev_peak_over_median'], '.2f')}  rej {100 * s['rejection_last']:.1f}%  "
                  f"{s['wall_s']:.0f}s  load {load:.1f}" + ("" if s["status"]["ok"] else f"  STOPPED: {s['status']['error'][:80]}"),
                  flush=True)
    print()
    text = table(results)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(), cpus=os.cpu_count(),
        argv=sys.argv, updates=args.updates, seeds=seeds, eval_every=every, eval_n=args.eval_n, window=args.window,
        rows={r: ROWS[r] for r in rows}, common=COMMON, extra=extra, table_markdown=text, results=results,
        total_wall_s=time.time() - t_all,
    ), indent=2, default=str))
    plot(results, Path(args.plot))
    print(f"\nwrote {out} and {args.plot}  ({time.time() - t_all:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
