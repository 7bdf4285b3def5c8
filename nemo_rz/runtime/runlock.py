"""One trainer per run directory: an exclusive lock on RUN/.lock, held until the process ends.

A flock belongs to the open file, so the kernel drops it when its holder exits, even on SIGKILL: a stale lock
never blocks a resume. The file holds the holder's pid, for the message to the one refused. It is opened only
as a regular file of the run directory: a .lock planted as a symlink (to a file the trainer's user may write)
is refused, never truncated through.
"""
from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from nemo_rz.errors import RunDirInUse

LOCK_FILE = ".lock"
_held: dict[Path, int] = {}  # run directory -> open lock file (this process may lock one directory twice)


def lock(run_dir: Path) -> None:
    key = Path(run_dir).resolve()
    if key in _held:
        return
    key.mkdir(parents=True, exist_ok=True)
    path = key / LOCK_FILE
    try:
        planted = not stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        planted = False
    fd = None if planted else os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    if fd is None or not stat.S_ISREG(os.fstat(fd).st_mode):
        if fd is not None:
            os.close(fd)
        what = f"a symlink (to {os.readlink(path)})" if os.path.islink(path) else "not a regular file"
        raise ValueError(f"run_dir {run_dir}: {LOCK_FILE} is {what}, not the lock file a trainer makes; "
                         f"remove it ({path}), then run again")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RunDirInUse(f"run_dir {run_dir} is in use by another trainer (pid {holder}); "
                          "wait for it to finish or stop it, then resume") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _held[key] = fd


def unlock(run_dir: Path) -> None:
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)
