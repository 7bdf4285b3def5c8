"""Writes that a crash cannot leave half done, for every file and directory the package writes.

Each is written under a temporary name beside its target and renamed into place once complete, so a reader
(or a resume after a crash) sees the old version or the new one, never a mix. This module imports nothing
from nemo_rz, so any layer may use it.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import secrets
import shutil
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


def _temp_name(target: Path, kind: str = "tmp") -> Path:
    return target.parent / f".{target.name}.{kind}-{secrets.token_hex(4)}"


def create(path: str | os.PathLike) -> int:
    """A new file opened for writing (never an existing one, never through a symlink), with a normal file's
    mode: 0o666 less the umask, applied by the system as to any file a program creates."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def write_all(fd: int, data) -> int:
    """Write every byte of `data` or raise OSError (a full disk makes os.write write less, then fail)."""
    view = memoryview(data).cast("B")
    n = view.nbytes
    while view:
        view = view[os.write(fd, view):]
    return n


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Replace the file at `path` with `data`."""
    path = Path(path)
    while True:
        tmp = _temp_name(path)
        try:
            fd = create(tmp)
            break
        except FileExistsError:
            continue
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace the file at `path` with `text`."""
    write_bytes(path, text.encode(encoding))


def finite_or_null(value):
    """`value` with every non-finite float (inf, -inf, nan) replaced by None, in nested dicts, lists and tuples."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json(path: str | os.PathLike, value, indent: int | None = 2) -> None:
    """Replace the file at `path` with `value` as standard JSON: a non-finite number (which json.dumps would
    write as Infinity or NaN, which other JSON readers refuse) is written as null."""
    write_text(path, json.dumps(finite_or_null(value), indent=indent, allow_nan=False) + "\n")


@contextlib.contextmanager
def new_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory beside `target`; when the block completes, it becomes `target`
    (an existing directory there is replaced only then), and when the block raises, it is removed."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp_dir(target)
    try:
        yield tmp
        fsync(tmp)
        _swap_in(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync(target.parent)


def _new_temp_dir(target: Path, kind: str = "tmp") -> Path:
    """An empty directory beside `target` with a normal directory's mode (0o777 less the umask)."""
    while True:
        tmp = _temp_name(target, kind)
        try:
            os.mkdir(tmp, 0o777)
            return tmp
        except FileExistsError:
            continue


def is_leftover(name: str, target_name: str | None = None) -> bool:
    """Whether `name` is a temporary name that new_dir or write_text gives (`target_name`'s, or any target's)."""
    if not name.startswith("."):
        return False
    stem, sep, tail = name[1:].rpartition(".")
    kind, dash, token = tail.partition("-")
    return bool(sep and dash and kind in ("tmp", "old") and token and (target_name is None or stem == target_name))


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
    if not os.path.lexists(target):  # (a symlink there, even a dangling one, is replaced like a directory)
        os.rename(tmp, target)
        return
    if _exchange(tmp, target):  # target now holds the new directory, tmp the old one
        _remove(tmp)
        return
    old = _new_temp_dir(target, "old")
    os.rmdir(old)
    os.rename(target, old)  # a crash between these two renames leaves the old directory intact at `old`
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)
        raise
    _remove(old)


def _remove(path: Path) -> None:
    """Remove a directory tree, or only the link when `path` is a symlink (never what it points to)."""
    if os.path.islink(path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def umask() -> int:
    """The process umask. Linux reports it in /proc/self/status; elsewhere reading it means setting it, so it is
    set straight back (a file another thread creates in between would get mode 0o666)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask
