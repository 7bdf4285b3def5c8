"""Metric back-ends (runtime/loggers.py): a tiny run (conftest.logged_run) logs the same keys, values and steps to
metrics.jsonl, TensorBoard, W&B (offline run files, read back from its .wandb log) and MLflow (a local file store,
read back through its client). Negative control: a record changed after the fact is caught by the comparison."""
from __future__ import annotations

import math

import pytest

from nemo_rz.runtime.loggers import scalars


def _tensorboard(run) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}


def _wandb(run) -> tuple[dict, dict]:
    import json

    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    (log,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    ds = datastore.DataStore()
    ds.open_for_scan(str(log))
    out, config = {}, {}
    while (data := ds.scan_data()) is not None:
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            step = items.pop("_step")
            out.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
        elif rec.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update})
    return out, config


def _mlflow(run) -> tuple[dict, dict]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "nemo-rz"]
    (found,) = client.search_runs([experiment.experiment_id])
    out = {(k, m.step): m.value for k in found.data.metrics for m in client.get_metric_history(found.info.run_id, k)}
    return out, found.data.params


def _expected(rows) -> dict:
    return {(k, r["update"]): v for r in rows for k, v in scalars(r).items()}


def _close(a: dict, b: dict, rel: float) -> bool:
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=rel, abs_tol=rel) for k in a)


def test_every_backend_holds_the_same_metrics(logged_run):
    run, rows = logged_run
    expected = _expected(rows)
    assert {"reward", "k3", "is_dev", "kernel_diff_tokens"} <= {k for k, _ in expected}
    wandb_metrics, wandb_config = _wandb(run)
    assert wandb_metrics == expected  # JSON: exact
    assert wandb_config["algo"]["value"]["max_lag"] == 2 if "value" in wandb_config.get("algo", {}) else \
        wandb_config["algo"]["max_lag"] == 2
    mlflow_metrics, params = _mlflow(run)
    assert mlflow_metrics == expected  # float64 in the file store: exact
    assert params["task.name"] == "hf_dataset" and params["algo.updates"] == "2"
    assert _close(_tensorboard(run), expected, 1e-6)  # TensorBoard keeps float32
    # negative control: one value off
    changed = dict(expected)
    key = next(iter(changed))
    changed[key] += 0.5
    assert wandb_metrics != changed and mlflow_metrics != changed and not _close(_tensorboard(run), changed, 1e-6)


def test_a_missing_backend_package_is_one_line(monkeypatch, tmp_path):
    import sys

    from nemo_rz.runtime import loggers

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r'metrics.wandb=true needs the wandb package: pip install -e ".\[loggers\]"'):
        loggers.Wandb(tmp_path, "p")
