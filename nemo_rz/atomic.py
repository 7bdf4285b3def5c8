"""Writes that a crash cannot leave half done, for every file and directory the package writes.

Each is written under a temporary name beside its target and renamed into place once complete, so a reader
(or a resume after a crash) sees the old version or the new one, never a mix. This module imports nothing
from nemo_rz, so any layer may use it.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync(path: str | os.PathLike) -> None:
    """Flush a file or directory to disk where the system allows it (best effort: some file systems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace the file at `path` with `text`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding=encoding) as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it private; the file gets a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def new_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside `target`; when the block completes, it becomes `target`
    (an existing directory there is replaced only then), and when the block raises, it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes it private; the result gets a normal directory's mode
    try:
        yield tmp
        fsync(tmp)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28; absent elsewhere
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _swap_in(tmp: Path, target: Path) -> None:
    """Put directory `tmp` at `target`; an existing `target` is replaced only once tmp is complete."""
    if not target.exists():
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):  # target now holds the new directory, tmp the old one
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.rename(target, old)  # a crash between these two renames leaves the old directory intact at `old`
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def umask() -> int:
    """The process umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
