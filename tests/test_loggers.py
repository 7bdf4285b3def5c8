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


def _wandb_records(path):
    """The protobuf records of a .wandb run file: W&B's 7-byte header, then LevelDB's log format (32 KiB blocks of
    chunks, each with a 7-byte header: CRC, length, type full / first / middle / last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, block, pieces = path.read_bytes(), 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pieces)
            yield rec


def _wandb(run) -> tuple[dict, dict]:
    import json

    (log,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    out, config = {}, {}
    for rec in _wandb_records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            step = items.pop("_step")
            out.update({(k, step): v for k, v in items.items() if not k.startswith("_")})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
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
    assert wandb_config["algo"]["max_lag"] == 2 and wandb_config["task"]["name"] == "hf_dataset"
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
