"""A heartbeat from a launched process to its launcher, over a pipe: the Megatron learner's ranks (launch.py).

The launcher makes one pipe per child (`Pipe`), hands it the write end (its number in ENV_HEARTBEAT); the child
writes a byte about every BEAT_EVERY_S seconds from a daemon thread of its own (`beat`), whatever its main thread
is doing: a slow step, or a wait inside a collective (which releases the GIL), still beats; a stopped process
(SIGSTOP), or one whose interpreter is stuck, falls silent. `Watch` says which child has been silent longer than
its limit: `timeout_s` once it has beaten, restarts.STARTUP_S (Python, torch and megatron-core starting on a busy
machine) before. The launcher's own absences (Ctrl-C's Ctrl-Z stops the whole job; a machine so starved the watch
itself does not run) are not counted as the children's silence. The clock is time.monotonic: a wall-clock jump is
no silence.
"""
from __future__ import annotations

import os
import threading
import time

from nemo_rz.runtime.restarts import STARTUP_S

ENV_HEARTBEAT = "NEMO_RZ_HEARTBEAT_FD"
BEAT_EVERY_S = 1.0
AWAY_S = 2.0  # a gap this long between two looks of the watch is the watch's own absence
_beating = False


def beat() -> None:
    """In a child: beat to the launcher, when it asked for it (ENV_HEARTBEAT); once per process."""
    global _beating
    fd = os.environ.get(ENV_HEARTBEAT)
    if _beating or not fd:
        return
    _beating, fd = True, int(fd)
    os.set_inheritable(fd, False)  # not passed on to programs this process starts

    def loop():
        while True:
            try:
                os.write(fd, b".")
            except OSError:  # the launcher is gone
                return
            time.sleep(BEAT_EVERY_S)

    threading.Thread(target=loop, name="nemo_rz-heartbeat", daemon=True).start()


class Pipe:
    """The launcher's end of one child's heartbeat. `child_env` and `child_fds` go to its Popen; `close_child_end`
    after it started."""

    def __init__(self):
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        self.last: float | None = None  # time.monotonic of the last beat read

    @property
    def child_env(self) -> dict[str, str]:
        return {ENV_HEARTBEAT: str(self._write)}

    @property
    def child_fds(self) -> tuple[int, ...]:
        return () if self._write is None else (self._write,)

    def close_child_end(self) -> None:
        if self._write is not None:
            os.close(self._write)
            self._write = None

    def read(self, now: float) -> None:
        try:
            if os.read(self.fd, 4096):
                self.last = now
        except BlockingIOError:
            pass

    def close(self) -> None:
        self.close_child_end()
        os.close(self.fd)


class Watch:
    """Which of the children (by index in `pipes`), if any, has been silent past its limit, and for how long."""

    def __init__(self, pipes: list[Pipe], timeout_s: float, startup_s: float = STARTUP_S):
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"megatron.heartbeat_s = {timeout_s!r}: expected a finite number of seconds > 0")
        self.pipes, self.timeout_s, self.startup_s = pipes, timeout_s, max(timeout_s, startup_s)
        self.started = self.seen = time.monotonic()

    def silent(self) -> tuple[int, float] | None:
        now = time.monotonic()
        away = now - self.seen
        if away > AWAY_S:  # the watch was not running: that time is nobody's silence
            self.started += away
            for p in self.pipes:
                if p.last is not None:
                    p.last += away
        self.seen = now
        for p in self.pipes:
            p.read(now)
        for i, p in enumerate(self.pipes):
            since, limit = (self.started, self.startup_s) if p.last is None else (p.last, self.timeout_s)
            if now - since > limit:
                return i, now - since
        return None
