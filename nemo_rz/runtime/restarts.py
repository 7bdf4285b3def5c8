"""How often a back-end may restart failed rollout workers before the run stops with the worker's own error.

A worker that dies now and then (killed, out of memory) is restarted and its jobs sent again. One that fails
every time (a setting it rejects, an error in its constructor) would be restarted forever: after
MAX_RESTARTS failures within RESTART_WINDOW_S seconds the run stops with the last failure in one line. A worker
that hangs (no heartbeat for runtime.worker_heartbeat_s seconds) is a failure too.
"""
from __future__ import annotations

import collections
import re
import time

from nemo_rz.errors import WorkerFailed

MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
# A worker beats a heartbeat from a thread of its own about once a second, however long its jobs take: one silent
# for HEARTBEAT_S seconds is stopped or stuck (or its machine is starved far past a slow worker's pace), and is
# killed and restarted under the same budget. A worker that has not beaten yet is still starting (Python, torch,
# Ray's actor start-up) and gets STARTUP_S.
HEARTBEAT_S = 60.0
STARTUP_S = 180.0


def one_line(exc: BaseException) -> str:
    """`Type: message` in one line. A Ray task error wraps the worker's own exception (`cause`); a Ray actor that
    died in its constructor carries that error as the last line of the traceback in its message."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
    if len(lines) > 1 and re.match(r"[\w.]+(Error|Exception|Interrupt): ", lines[-1]):
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0]}"


def check_heartbeat(seconds) -> float:
    """runtime.worker_heartbeat_s: a finite number of seconds > 0."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(seconds, bool) or not 0 < value < float("inf"):
        raise ValueError(f"runtime.worker_heartbeat_s = {seconds!r}: expected a finite number of seconds > 0")
    return value


class RestartBudget:
    def __init__(self, limit: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S):
        self.limit, self.window_s = limit, window_s
        self.failures: collections.deque[float] = collections.deque()
        self.restarts = 0

    def spend(self, worker: int, error: str) -> None:
        """Record a failure of `worker`; raise WorkerFailed when it would be one restart too many."""
        now = time.monotonic()
        while self.failures and now - self.failures[0] > self.window_s:
            self.failures.popleft()
        self.failures.append(now)
        if len(self.failures) > self.limit:
            raise WorkerFailed(f"rollout worker {worker} failed {len(self.failures)} times within {self.window_s:.0f}s "
                               f"(restarts stop after {self.limit}); last error: {error}")
        self.restarts += 1
