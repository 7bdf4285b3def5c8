"""A run's metrics.jsonl (one JSON object per update) and the other back-ends it feeds (runtime/loggers.py:
TensorBoard, Weights & Biases, MLflow): the same finite numbers at the same step (the record's update) in all."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from nemo_rz import atomic
from nemo_rz.errors import BadInput
from nemo_rz.runtime.peer_metrics import peer_names


def _open(path: Path, flags: int) -> int:
    """The run's own metrics.jsonl, never through a symlink or into a FIFO or device planted in its place."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
    except OSError:
        if os.path.islink(path):
            raise BadInput(f"{path} is a symlink, not the run's own metrics file; remove it, then resume") from None
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):  # a FIFO without a reader, a socket
            raise BadInput(f"{path} is not a regular file; remove it, then resume") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"{path} is not a regular file; remove it, then resume")
    return fd


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.backends = []  # runtime.loggers back-ends (log(scalars, step), close()), set by the caller (train.py)

    def write(self, record: dict) -> None:
        """Append `record`, with its mismatch metrics also under the peers' names (peer_metrics.py)."""
        record = {**record, **peer_names(record)}
        with os.fdopen(_open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.backends:
            from nemo_rz.runtime.loggers import scalars

            values = scalars(record)
            for backend in self.backends:
                backend.log(values, record["update"])

    def keep_until(self, version: int) -> None:
        """Drop the lines of updates after `version` (an interrupted run's, about to be replayed) and a last line
        cut short by a crash mid-write."""
        if not os.path.lexists(self.path):
            return
        with os.fdopen(_open(self.path, os.O_RDONLY), errors="replace") as f:
            lines = f.read().splitlines()
        kept = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("update", math.inf) <= version:
                kept.append(line)
        atomic.write_text(self.path, "".join(line + "\n" for line in kept))

    def close(self) -> None:
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close()
