"""Which kernel set the ops run: `consistent` (batch-invariant, the default) or `fast` (library defaults).

The switch is process-wide, like vLLM's VLLM_BATCH_INVARIANT: the rollout engine and the learner read the
same switch, so the same process never mixes the two sets by accident.
"""
from __future__ import annotations

import contextlib
import os

MODES = ("consistent", "fast")
_ENV = "NEMO_RZ_KERNELS"


def _check(name: str, where: str) -> str:
    if name not in MODES:
        raise ValueError(f"unknown kernel mode {name!r} in {where}: use one of {', '.join(MODES)}")
    return name


_mode = _check(os.environ.get(_ENV, "consistent"), f"environment variable {_ENV}")


def get_mode() -> str:
    return _mode


def set_mode(name: str) -> None:
    """Select the kernel set for every op in this process."""
    global _mode
    _mode = _check(name, "nemo_rz.ops.set_mode")


@contextlib.contextmanager
def mode(name: str):
    """Run a block with the given kernel set, restoring the previous one afterwards."""
    previous = get_mode()
    set_mode(name)
    try:
        yield
    finally:
        set_mode(previous)


def consistent() -> bool:
    return _mode == "consistent"
