"""`python -m nemo_rz.train [--config FILE] key=value ...`: asynchronous REINFORCE Zero on one machine.

The default job (conf/default.yaml) warms a tiny model up on 2-digit addition, then trains it with
asynchronous REINFORCE Zero (max_lag 2) and prints held-out pass@1 before and after. A run directory holds
config.yaml, metrics.jsonl, TensorBoard events, checkpoints/, plots/*.png and summary.json.
"""
from __future__ import annotations

import errno
import signal
import sys
import threading
import time
from pathlib import Path

from omegaconf import OmegaConf

from nemo_rz import atomic
from nemo_rz import config as config_lib
from nemo_rz.errors import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_WORKER_FAILED,
    ArgumentParser,
    ConfigError,
    DivergenceError,
    Terminated,
    WorkerFailed,
)
from nemo_rz.runtime import runlock


def _args(argv):
    ap = ArgumentParser(prog="python -m nemo_rz.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML file, or a preset name such as smollm2_arith, merged over conf/default.yaml "
                                     "(on resume: over the run's config)")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. algo.max_lag=8 runtime.rollout_workers=2")
    return ap.parse_args(argv)


def _launch(argv) -> int | None:
    """runtime.learner=megatron over several processes: start them and return the job's exit code, or serve
    rank 0's learner calls (a rank other than 0); None: this process runs the trainer."""
    args = _args(argv)
    cfg = config_lib.load(args.config, args.overrides)
    if OmegaConf.select(cfg, "runtime.learner") != "megatron":
        return None
    from nemo_rz.runtime.megatron import launch

    rank, world = launch.this_rank(), launch.world_size(cfg)
    if rank is None and world > 1:
        argv = list(sys.argv[1:] if argv is None else argv)
        run_dir = cfg.resume or cfg.run_dir
        if run_dir is None:  # every rank must agree on it
            run_dir = f"runs/{cfg.task.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            argv.append(f"run_dir={run_dir}")
        heartbeat_s = float(OmegaConf.select(cfg, "megatron.heartbeat_s"))
        return launch.start([sys.executable, "-m", "nemo_rz.train", *argv], world, run_dir, heartbeat_s=heartbeat_s)
    if rank:
        launch.follow(cfg)
        return 0
    if rank == 0:
        launch.lead()
    return None


def _prepare(argv) -> tuple:
    """The validated config and its run directory. A new run writes config.yaml now; a resumed run only
    once its checkpoint is restored (run()), so that a refused resume leaves the run directory untouched."""
    args = _args(argv)
    cfg = config_lib.load(args.config, args.overrides, log=print)
    if cfg.resume:
        run_dir = Path(cfg.resume)
    else:
        run_dir = Path(cfg.run_dir or f"runs/{cfg.task.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        if any((run_dir / name).exists() for name in ("checkpoints", "metrics.jsonl", config_lib.RUN_CONFIG)):
            raise ConfigError(f"run_dir {run_dir} already holds a run; pass resume={run_dir} to continue it or choose a new run_dir")
        # a run directory's lock alone: a trainer is starting there (runlock says which)
        if run_dir.exists() and (not run_dir.is_dir() or any(p.name != runlock.LOCK_FILE for p in run_dir.iterdir())):
            what = "a folder with other files in it" if run_dir.is_dir() else "not a folder"
            raise ConfigError(f"run_dir {run_dir} is {what}, not a run; choose a new or empty run_dir")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"run_dir {run_dir}: cannot create it ({e.strerror}); choose another run_dir") from None
        cfg.run_dir = str(run_dir)
    runlock.lock(run_dir)  # a second trainer on this run directory stops here, before writing anything
    if not cfg.resume:
        atomic.write_text(run_dir / config_lib.RUN_CONFIG, OmegaConf.to_yaml(cfg))
    return cfg, run_dir


def run(cfg, run_dir: Path) -> dict:
    from nemo_rz.runtime.trainer import Trainer

    trainer = Trainer(cfg, run_dir, Path(cfg.resume) if cfg.resume else None)
    if cfg.resume:  # restored: the changes this resume made (already checked) now belong to the run
        atomic.write_text(run_dir / config_lib.RUN_CONFIG, OmegaConf.to_yaml(cfg))
    from nemo_rz.runtime.loggers import open_backends

    trainer.metrics_log.backends = open_backends(trainer.cfg.metrics, run_dir, OmegaConf.to_container(cfg, resolve=True))
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
        trainer.metrics_log.close()
    atomic.write_json(run_dir / "summary.json", summary)  # strict JSON: a non-finite figure is null
    from nemo_rz.tools.report import write_plots

    write_plots(run_dir)
    if cfg.export.on_finish:
        from nemo_rz.tools.export import export_on_finish

        export_on_finish(run_dir)
    return summary


def print_summary(summary: dict, run_dir: Path) -> None:
    print(f"\nrun directory: {run_dir}")
    print(f"held-out pass@1: {summary['heldout_pass_at_1_start']:.3f} -> {summary['heldout_pass_at_1_end']:.3f} "
          f"({summary['heldout_gain_points']:+.1f} points) in {summary['updates']} updates, {summary['seconds']:.0f}s")
    print(f"trajectories: produced {summary['produced']} = trained {summary['trained']} + refused {summary['refused'] or 0} "
          f"+ pending {summary['pending']}")
    print(f"lag histogram: {summary['lag_histogram']}   is_dev peak/median: {summary['is_dev_peak_over_median']:.2f}   "
          f"max grad norm: {summary['max_grad_norm']:.3g}")


def _os_error(e: OSError, run_dir: Path | None) -> str:
    where = f"{e.filename}: " if e.filename else ""
    if e.errno == errno.ENOSPC:
        return f"{where}{e.strerror}; free some space, then " + (f"resume with resume={run_dir}" if run_dir else "run again")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{where}{e.strerror}; choose a writable run_dir (or fix its permissions)"
    return f"{where}{e.strerror or e}"


class _SigtermRaises:
    """SIGTERM (a scheduler stopping the job) raises Terminated in the main thread, once: the run unwinds as on
    Ctrl-C (rollout workers and ranks stopped, TensorBoard flushed, the last checkpoint kept). A second SIGTERM
    while it unwinds is ignored, so that the clean-up finishes; SIGKILL remains the way to stop it at once."""

    def __init__(self):
        self.received, self.previous = False, None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._raise)
        return self

    def _raise(self, signum, frame):
        if not self.received:
            self.received = True
            raise Terminated()

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False


def _stopped(e: KeyboardInterrupt, run_dir: Path | None) -> int:
    word, code = ("terminated", EXIT_TERMINATED) if isinstance(e, Terminated) else ("interrupted", EXIT_INTERRUPTED)
    print(f"{word}; resume with resume={run_dir}" if run_dir else word, file=sys.stderr)
    return code


def main(argv=None) -> int:
    """Every failure a user can cause is one line on stderr: bad input exit 2, divergence 3, rollout workers that
    keep failing 4, Ctrl-C 130, SIGTERM 143."""
    run_dir = None
    with _SigtermRaises() as sigterm:
        try:
            launched = _launch(argv)
            if launched is not None:
                return launched
            cfg, run_dir = _prepare(argv)
            summary = run(cfg, run_dir)
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (Terminated)
            return _stopped(Terminated() if sigterm.received else e, run_dir)
        except Exception as e:
            if sigterm.received:  # an error met while stopping (a worker already gone): the stop is what happened
                return _stopped(Terminated(), run_dir)
            if isinstance(e, DivergenceError):
                print(f"error: {e}", file=sys.stderr)
                return EXIT_DIVERGED
            if isinstance(e, WorkerFailed):
                print(f"error: {e}", file=sys.stderr)
                return EXIT_WORKER_FAILED
            if isinstance(e, ValueError):  # bad config, data, checkpoints or model files
                print(f"error: {e}", file=sys.stderr)
                return EXIT_BAD_INPUT
            if isinstance(e, OSError):  # an unwritable run directory, a full disk
                print(f"error: {_os_error(e, run_dir)}", file=sys.stderr)
                return EXIT_BAD_INPUT
            raise
    print_summary(summary, run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
