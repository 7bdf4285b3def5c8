"""A run's metrics.jsonl (one JSON object per update) and, when wanted, TensorBoard."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from nemo_rz import atomic
from nemo_rz.errors import BadInput


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
        self.tb = None  # a TensorBoard SummaryWriter, set by the caller (train.py) when wanted

    def write(self, record: dict) -> None:
        with os.fdopen(_open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["update"])

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
        if self.tb is not None:
            self.tb.close()
