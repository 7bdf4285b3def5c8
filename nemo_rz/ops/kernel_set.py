"""Which kernel set the ops run: `consistent` (batch-invariant, the default) or `fast` (library defaults).

One name everywhere: the config key `kernels` (and `runtime.rollout_kernels`), the environment variable
NEMO_RZ_KERNELS, the `--kernels` flag of the tools, and here. The switch is process-wide, like vLLM's
VLLM_BATCH_INVARIANT: the rollout engine and the learner read the same switch, so the same process never mixes
the two sets by accident.
"""
from __future__ import annotations

import contextlib
import os

KERNELS = ("consistent", "fast")
_ENV = "NEMO_RZ_KERNELS"


def _check(name: str, where: str) -> str:
    if name not in KERNELS:
        raise ValueError(f"unknown kernel set {name!r} in {where}: use one of {', '.join(KERNELS)}")
    return name


_kernels = _check(os.environ.get(_ENV, "consistent"), f"environment variable {_ENV}")


def get_kernels() -> str:
    return _kernels


def set_kernels(name: str) -> None:
    """Select the kernel set for every op in this process."""
    global _kernels
    _kernels = _check(name, "nemo_rz.ops.set_kernels")


@contextlib.contextmanager
def use_kernels(name: str):
    """Run a block with the given kernel set, restoring the previous one afterwards."""
    previous = get_kernels()
    set_kernels(name)
    try:
        yield
    finally:
        set_kernels(previous)


def consistent() -> bool:
    return _kernels == "consistent"
