"""Use nemo-rz as a library: train the tiny addition model with asynchronous REINFORCE Zero from Python.

    python examples/tiny_math_rl.py            # ~1 minute on 2 CPU cores
"""
from pathlib import Path

from nemo_rz import config
from nemo_rz.runtime.trainer import Trainer

if __name__ == "__main__":  # rollout workers are spawned processes: keep the guard
    cfg = config.load(None, ["task.name=add1", "warmup.steps=150", "algo.updates=150", "algo.max_lag=4",
                             "eval.every=50", "progress=false", "metrics.tensorboard=false"])
    run_dir = Path("runs/example-tiny-math")
    run_dir.mkdir(parents=True, exist_ok=True)
    summary = Trainer(cfg, run_dir).run()
    print({k: summary[k] for k in ("heldout_pass_at_1_start", "heldout_pass_at_1_end", "lag_histogram", "produced", "trained")})
