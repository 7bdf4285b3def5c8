"""Probe results of ops/verified.py kept on disk, so that a new process need not probe again.

A probe's result depends on the machine and the software under it, so results live in one JSON file per machine
key: the CPU (model and flags from /proc/cpuinfo, else platform.processor()), torch's version and build (its
config, which names the BLAS and oneDNN vendors and versions and the CPU capability in use), the environment
variables that pick other BLAS or ATen code paths, the probe version (verified.PROBE_VERSION, bumped when probe
logic changes), a digest of the ops sources (the probed row-wise functions live there: editing one probes again)
and the probe's thread count. Probes run on one thread whatever the process's count, so that count
is 1 in every key: a 2-thread learner and a 1-thread rollout worker share one file, as they share one route.
Entries are keyed by kind, shape key, dtype and device (CPU only: the key says nothing about a GPU).

The directory is $NEMO_RZ_CACHE_DIR, else $XDG_CACHE_HOME/nemo_rz, else ~/.cache/nemo_rz; NEMO_RZ_PROBE_CACHE=0
turns the cache off. Writers merge under an flock of a lock file beside the cache file and replace the file
atomically, so concurrent processes neither lose each other's entries nor leave a torn file. A file that is
unreadable, corrupt, another key's, a symlink, not a regular file or another user's is ignored (one warning line
per process) and rewritten; no cache problem stops a run.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import stat
import sys
import threading
from pathlib import Path

import torch

from nemo_rz import atomic

FORMAT = 1  # the file layout; bumped when it changes
MAX_FILE_BYTES = 1 << 22  # a cache file is a few kB; a larger one is not ours
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags",  # x86
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision", "Features")  # Arm
# Environment variables that make MKL, oneDNN or ATen take other code paths on the same machine.
PATH_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "MKL_DEBUG_CPU_TYPE", "DNNL_MAX_CPU_ISA",
            "ONEDNN_MAX_CPU_ISA", "LD_PRELOAD")

_files: dict[Path, dict] = {}  # cache file -> its entries as this process last read or wrote them
_lock = threading.Lock()
_warned = False


def enabled() -> bool:
    return os.environ.get("NEMO_RZ_PROBE_CACHE", "1") != "0"


def cache_dir() -> Path:
    if os.environ.get("NEMO_RZ_CACHE_DIR"):
        return Path(os.environ["NEMO_RZ_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nemo_rz"


def cpu_description() -> dict[str, str]:
    """The first processor's identifying fields from /proc/cpuinfo (all processors of a machine are alike here);
    platform.processor() and platform.machine() where there is no /proc/cpuinfo."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                name = name.strip()
                if not sep:
                    if fields:
                        break  # the end of the first processor's block
                    continue
                if name in CPU_FIELDS:
                    fields[name] = value.strip()
    except OSError:
        pass
    return fields or {"processor": platform.processor(), "machine": platform.machine()}


@functools.cache
def ops_sources_digest() -> str:
    """A digest of this package's ops/*.py (read once per process)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def machine_key(probe_version: int, probe_threads: int) -> dict:
    """Everything besides the entry's own key that can change a probe's result."""
    return {
        "format": FORMAT,
        "probe_version": probe_version,
        "ops_sources": ops_sources_digest(),
        "probe_threads": probe_threads,
        "cpu": cpu_description(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "torch_build": torch.__config__.show(),  # BLAS_INFO, MKL and oneDNN versions, compiler flags
        "mkl": torch.backends.mkl.is_available(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "env": {name: os.environ[name] for name in PATH_ENV if name in os.environ},
    }


def entry_name(key: tuple) -> str:
    """The JSON object key of a probe entry: (kind, shape..., dtype, device) as strings."""
    return json.dumps([str(part) for part in key])


def warn(message: str) -> None:
    """Print `message` as one warning line, if this process has printed none yet."""
    global _warned
    if not _warned:
        _warned = True
        print(f"warning: nemo_rz probe cache: {message}", file=sys.stderr, flush=True)


def _file_for(machine: dict) -> Path:
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"probes-{digest}.json"


def _open_regular(path: Path, flags: int) -> int | None:
    """A file descriptor on `path` when it is a regular file of this user (never through a symlink, never blocking
    on a FIFO); None where there is no such file; OSError with the reason otherwise."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP or os.path.islink(path):
            raise OSError(f"{path.name} is a symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise OSError(f"{path.name} is {'not a regular file' if not stat.S_ISREG(st.st_mode) else 'another user’s file'}")
    return fd


def _read(path: Path, machine: dict) -> dict:
    """The entries in `path` ({} where it is missing; {} and a warning where it cannot be used)."""
    try:
        fd = _open_regular(path, os.O_RDONLY)
        if fd is None:
            return {}
        try:
            data = os.read(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError("larger than a probe cache file can be")
        value = json.loads(data)
        if not (isinstance(value, dict) and value.get("machine") == machine and isinstance(value.get("entries"), dict)):
            raise ValueError("not a probe cache file of this machine key")
        return value["entries"]
    except (OSError, ValueError) as e:  # (json's errors are ValueErrors, UnicodeDecodeError too)
        warn(f"ignoring {path} ({e}); probing again and rewriting it")
        return {}


def lookup(key: tuple, machine: dict):
    """(True, the stored result) for the probe entry `key` under `machine`, or (False, None)."""
    path = _file_for(machine)
    with _lock:
        if path not in _files:
            _files[path] = _read(path, machine)
        entries = _files[path]
    name = entry_name(key)
    return (True, entries[name]) if name in entries else (False, None)


def store(key: tuple, value, machine: dict) -> None:
    """Add the probe entry `key` (a JSON value) to the file of `machine`, keeping what other processes wrote."""
    path = _file_for(machine)
    with _lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with _locked(path.with_suffix(".lock")):
                entries = _read(path, machine)
                entries[entry_name(key)] = value
                atomic.write_json(path, {"machine": machine, "entries": entries}, indent=1)
            _files[path] = entries
        except OSError as e:
            warn(f"cannot write {path} ({e}); later processes will probe again")


@contextlib.contextmanager
def _locked(path: Path):
    fd = _open_regular(path, os.O_RDWR | os.O_CREAT)
    if fd is None:
        raise OSError(f"{path.parent} is gone")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing drops the lock)

