"""Metric back-ends beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow, behind one small interface.

A back-end is an object with `log(scalars: dict[str, float], step: int)` and `close()`; MetricsLog (metrics_log.py)
writes each update's record to metrics.jsonl and hands the same finite numbers (`scalars`), at step = the record's
`update`, to every back-end, so all of them hold the same keys, values and steps. `open_backends` builds the ones
the metrics section asks for; each library is imported only when chosen (`pip install -e ".[loggers]"`):

  metrics.tensorboard: true    RUN_DIR/tb event files (torch.utils.tensorboard)
  metrics.wandb: true          a W&B run in RUN_DIR/wandb: project metrics.project, name = the run directory's name,
                               the run's config as its config; offline (synced later with `wandb sync`) unless
                               WANDB_API_KEY or WANDB_MODE is set
  metrics.mlflow: true         an MLflow run in experiment metrics.project, the config's keys as parameters; tracking
                               store metrics.mlflow_uri, default file://RUN_DIR/mlruns (MLFLOW_TRACKING_URI wins
                               when set and mlflow_uri is null)
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Protocol


class MetricsBackend(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers (booleans and non-finite values are left out): what every back-end logs."""
    return {k: float(v) for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def _require(module: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"metrics.{key}=true needs the {module} package: pip install -e \".[loggers]\" "
                         f"(or set metrics.{key}=false)") from None


class TensorBoard:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / "tb"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, run_dir: Path, project: str, config: dict | None = None):
        wandb = _require("wandb", "wandb")
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        folder = Path(run_dir) / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=Path(run_dir).name, dir=str(run_dir), mode=mode, config=config or {},
                              reinit="create_new")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    def __init__(self, run_dir: Path, project: str, uri: str | None = None, config: dict | None = None):
        _require("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir).resolve() / "mlruns").as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch (a database URI needs none)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=Path(run_dir).name).info.run_id
        self.uri = uri
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in _flat(config or {}).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, scalars: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def open_backends(metrics, run_dir: Path, config: dict | None = None) -> list[MetricsBackend]:
    """The back-ends a typed metrics section asks for (config: the run's resolved config, logged by W&B and MLflow)."""
    out: list[MetricsBackend] = []
    try:
        if metrics.tensorboard:
            out.append(TensorBoard(run_dir))
        if metrics.wandb:
            out.append(Wandb(run_dir, metrics.project, config))
        if metrics.mlflow:
            out.append(Mlflow(run_dir, metrics.project, metrics.mlflow_uri, config))
    except BaseException:
        for backend in out:
            backend.close()
        raise
    return out
