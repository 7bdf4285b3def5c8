"""`python -m nemo_rz.train [--config FILE] key=value ...`: asynchronous REINFORCE Zero on one machine.

The default job (conf/default.yaml) warms a tiny model up on 2-digit addition, then trains it with
asynchronous REINFORCE Zero (max_lag 2) and prints held-out pass@1 before and after. A run directory holds
config.yaml, metrics.jsonl, TensorBoard events, checkpoints/, plots/*.png and summary.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from nemo_rz import config as config_lib
from nemo_rz.runtime import runlock


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prepare(argv) -> tuple:
    ap = argparse.ArgumentParser(prog="python -m nemo_rz.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML file merged over conf/default.yaml")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. algo.max_lag=8 runtime.rollout_workers=2")
    args = ap.parse_args(argv)
    cfg = config_lib.load(args.config, args.overrides)
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise ValueError(f"resume={cfg.resume}: {saved} not found; point resume at a run directory made by nemo_rz.train")
        # The saved config, with this command line's overrides on top (e.g. more algo.updates).
        cfg = OmegaConf.merge(OmegaConf.load(saved), OmegaConf.from_dotlist([o for o in args.overrides if not o.startswith("resume=")]))
        cfg.resume = str(run_dir)
    else:
        run_dir = Path(cfg.run_dir or f"runs/{cfg.task.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run_dir / "checkpoints").exists() or (run_dir / "metrics.jsonl").exists():
            raise ValueError(f"run_dir {run_dir} already holds a run; pass resume={run_dir} to continue it or choose a new run_dir")
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.run_dir = str(run_dir)
    runlock.lock(run_dir)  # a second trainer on this run directory stops here, before writing anything
    _write_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(cfg))
    return cfg, run_dir


def run(cfg, run_dir: Path) -> dict:
    from nemo_rz.runtime.trainer import Trainer

    trainer = Trainer(cfg, run_dir, Path(cfg.resume) if cfg.resume else None)
    if cfg.metrics.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        trainer.tb = SummaryWriter(str(run_dir / "tb"))
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.algo.updates, initial=trainer.version, desc="updates", unit="upd", dynamic_ncols=True, file=sys.stderr)

    def progress(record):
        bar.update(1)
        shown = {"reward": f"{record['reward']:.2f}", "lag": record["lag"]}
        if "heldout_pass_at_1" in record:
            progress.last_eval = record["heldout_pass_at_1"]
        if progress.last_eval is not None:
            shown["heldout"] = f"{progress.last_eval:.2f}"
        bar.set_postfix(shown)

    progress.last_eval = None
    try:
        summary = trainer.run(progress if bar else None)
    finally:
        if bar is not None:
            bar.close()
        if trainer.tb is not None:
            trainer.tb.close()
    _write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2))
    from nemo_rz.tools.report import write_plots

    write_plots(run_dir)
    return summary


def print_summary(summary: dict, run_dir: Path) -> None:
    print(f"\nrun directory: {run_dir}")
    print(f"held-out pass@1: {summary['heldout_pass_at_1_start']:.3f} -> {summary['heldout_pass_at_1_end']:.3f} "
          f"({summary['heldout_gain_points']:+.1f} points) in {summary['updates']} updates, {summary['seconds']:.0f}s")
    print(f"trajectories: produced {summary['produced']} = trained {summary['trained']} + refused {summary['refused'] or 0} + pending {summary['pending']}")
    print(f"lag histogram: {summary['lag_histogram']}   is_dev peak/median: {summary['is_dev_peak_over_median']:.2f}   "
          f"max grad norm: {summary['max_grad_norm']:.3g}")


def main(argv=None) -> int:
    try:
        cfg, run_dir = _prepare(argv)
        summary = run(cfg, run_dir)
    except ValueError as e:  # bad config, data or model files: one line, exit 2 (DESIGN.md contract 7)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(summary, run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
