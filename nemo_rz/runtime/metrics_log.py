"""A run's metrics.jsonl (one JSON object per update) and, when wanted, TensorBoard."""
from __future__ import annotations

import json
import math
from pathlib import Path

from nemo_rz import atomic


class MetricsLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None  # a TensorBoard SummaryWriter, set by the caller (train.py) when wanted

    def write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, record["update"])

    def keep_until(self, version: int) -> None:
        """Drop the lines of updates after `version` (an interrupted run's, about to be replayed) and a last line
        cut short by a crash mid-write."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text(errors="replace").splitlines():
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
