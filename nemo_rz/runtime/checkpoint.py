"""Checkpoints: weights (safetensors), recent weight versions, optimizer, RNG, and queue state.

Written to a temporary directory and renamed into place, so an interrupted save never damages the last
good checkpoint; what a killed save leaves behind is removed on resume. A manifest holds each file's size
and SHA-256, and the update it belongs to: a checkpoint whose files do not match it (truncated, corrupted or
edited), whose folder name disagrees with it (renamed or copied in), or whose trainer state lacks a part is
skipped for the newest intact one, and rotating old checkpoints out never counts a damaged one as kept.

A run directory is not trusted. Nothing is unpickled: tensors come from safetensors, optimizer and trainer
state from torch.load(weights_only=True), which builds only tensors and plain containers, so a pickle
planted in a run directory cannot run code. Only regular files inside the run directory are read: a
symlink (to another run, or to /dev/zero), a FIFO or a device in place of a checkpoint file or folder is
refused before it is opened, so it can neither hang a resume nor roll it back.

Every file a checkpoint holds gets a normal file's mode (0o666 less the umask), and a write that fails (a
full disk) is an OSError naming the checkpoint, never torch's or safetensors' own error.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from nemo_rz import atomic
from nemo_rz.errors import CorruptCheckpoint

MANIFEST = "manifest.json"
FILES = ("model.safetensors", "history.safetensors", "optimizer.pt", "state.pt")
MAX_MANIFEST_BYTES = 1 << 20
_NAME = re.compile(r"step_[0-9]+")
_known_good: dict[Path, tuple] = {}  # checkpoint -> its files' identities when this process last found it intact


def _flatten_history(history: dict[int, dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The weight versions as one safetensors table, and {key: earlier key} for a tensor that is an earlier
    version's own (a frozen base, as LoRA versions share it): written once, named again in the metadata."""
    flat: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for v, sd in history.items():
        for k, t in sd.items():
            key = f"v{v}/{k}"
            same = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if same in first and t.numel():
                aliases[key] = first[same]
            else:
                first[same] = key
                flat[key] = t.contiguous()
    return flat, aliases


def _unflatten_history(flat: dict[str, torch.Tensor], aliases: dict[str, str], path: Path) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, held in aliases.items():
        if held not in flat:
            raise CorruptCheckpoint(f"checkpoint {path}: history.safetensors names {key[:80]!r} as {held[:80]!r}, which it lacks")
        flat[key] = flat[held]
    for key, t in flat.items():
        v, _, name = key.partition("/")
        if not (name and v[:1] == "v" and v[1:].isascii() and v[1:].isdigit()):
            raise CorruptCheckpoint(f"checkpoint {path}: history.safetensors holds {key[:80]!r}, not a weight version's tensor")
        out.setdefault(int(v[1:]), {})[name] = t
    return out


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


# -- reading only regular files --------------------------------------------------------------------------

def _kind(path: Path, st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        try:
            return f"a symlink (to {os.readlink(path)})"
        except OSError:
            return "a symlink"
    for test, name in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket")):
        if test(st.st_mode):
            return name
    return "not a regular file"  # (a door, a whiteout...)


def _open_regular(path: Path, where: Path) -> int:
    """A read-only descriptor of the regular file at `path`, checked before it is opened (a FIFO would block
    the open, /dev/zero would never end) and again once open; CorruptCheckpoint for anything else."""
    try:
        before = os.lstat(path)
        if not stat.S_ISREG(before.st_mode):
            raise CorruptCheckpoint(f"checkpoint {where}: {path.name} is {_kind(path, before)}, not a regular file of "
                                    "this run; not read")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CorruptCheckpoint(f"checkpoint {where}: cannot read {path.name} ({e.strerror})") from None
    now = os.fstat(fd)
    if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (before.st_dev, before.st_ino):
        os.close(fd)
        raise CorruptCheckpoint(f"checkpoint {where}: {path.name} changed while it was being opened; not read")
    return fd


def _check_folder(path: Path) -> None:
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CorruptCheckpoint(f"checkpoint {path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CorruptCheckpoint(f"checkpoint {path} is {_kind(path, st)}, not a folder of this run; not read")


def _sha256(path: Path, where: Path | None = None, size: int | None = None) -> str:
    fd = _open_regular(path, where or path.parent)
    with os.fdopen(fd, "rb") as f:
        actual = os.fstat(fd).st_size
        if size is not None and actual != size:
            raise CorruptCheckpoint(f"checkpoint {where or path.parent}: {path.name} does not match its checksum "
                                    f"({actual} bytes, the manifest says {size}: truncated or modified)")
        try:
            return hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as e:
            raise CorruptCheckpoint(f"checkpoint {where or path.parent}: cannot read {path.name} ({e.strerror})") from None


def _manifest(path: Path) -> dict:
    fd = _open_regular(path / MANIFEST, path)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise ValueError("too large")
        manifest = json.loads(data)
        if not isinstance(manifest, dict) or not isinstance(manifest.get("sha256"), dict):
            raise TypeError("no sha256 table")
    except (OSError, ValueError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: unreadable {MANIFEST} ({type(e).__name__})") from None
    version = manifest.get("version")
    if type(version) is not int or version != _step(path):
        raise CorruptCheckpoint(f"checkpoint {path}: its {MANIFEST} is of update {version!r}, not {_step(path)} "
                                "(renamed, or copied from another run)")
    sizes = manifest.get("bytes")
    if sizes is not None and not isinstance(sizes, dict):
        raise CorruptCheckpoint(f"checkpoint {path}: unreadable {MANIFEST} (bytes is not a table)")
    return manifest


def _identity(path: Path) -> tuple:
    """What changes when any file of a checkpoint is replaced or rewritten."""
    out = []
    for name in (MANIFEST, *FILES):
        st = os.lstat(path / name)
        out.append((st.st_mode, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def checkpoints(ckpt_dir: Path) -> list[Path]:
    """Every entry named like a checkpoint (step_<update>), newest first: complete or not, intact or not,
    folders or not (verify says which)."""
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise CorruptCheckpoint(f"{ckpt_dir}: cannot list its checkpoints ({e.strerror})") from None
    return sorted((Path(ckpt_dir) / n for n in names if _NAME.fullmatch(n)), key=_step, reverse=True)


def verify(path: Path) -> None:
    """Raise CorruptCheckpoint unless `path` is a folder (not a symlink) whose manifest names its update and
    whose files are regular files that match the manifest's sizes and checksums."""
    path = Path(path)
    _check_folder(path)
    if not os.path.lexists(path / MANIFEST):
        raise CorruptCheckpoint(f"checkpoint {path}: no {MANIFEST} (incomplete, or written before checkpoints had checksums)")
    manifest = _manifest(path)
    expected, sizes = manifest["sha256"], manifest.get("bytes") or {}
    for name in FILES:
        size = sizes.get(name)
        if _sha256(path / name, path, size if type(size) is int else None) != expected.get(name):
            raise CorruptCheckpoint(f"checkpoint {path}: {name} does not match its checksum (truncated or modified)")


def _intact(path: Path) -> bool:
    try:
        if _known_good.get(path) == _identity(path):
            return True
        verify(path)
        _known_good[path] = _identity(path)
        return True
    except (CorruptCheckpoint, OSError):
        return False


def latest(ckpt_dir: Path) -> Path | None:
    """The newest intact checkpoint (each one checked afresh)."""
    for path in checkpoints(ckpt_dir):
        try:
            verify(path)
            return path
        except CorruptCheckpoint:
            continue
    return None


# -- writing ---------------------------------------------------------------------------------------------

class _Sink:
    """The file object torch.save writes to: every byte lands or OSError is raised, and kept (torch writing to
    a path itself turns a full disk into RuntimeError 'unexpected pos'; writing to a file object, it still
    finishes the archive after the failed write, which raises that RuntimeError in place of the OSError)."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None

    def write(self, data) -> int:
        if self.error is not None:
            raise self.error
        try:
            return atomic.write_all(self.fd, data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        pass


def _torch_save(obj, path: Path) -> None:
    fd = atomic.create(path)
    sink = _Sink(fd)
    try:
        torch.save(obj, sink)
        os.fsync(fd)
    except Exception:
        if sink.error is None:
            raise
        raise OSError(sink.error.errno, sink.error.strerror, str(path)) from None
    finally:
        os.close(fd)


def _safetensors_save(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as e:  # "Error while serializing: I/O error: No space left on device (os error 28)"
        found = re.search(r"os error (\d+)", str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None
    os.chmod(path, 0o666 & ~atomic.umask())  # safetensors writes it private (0o600): give it a normal file's mode
    atomic.fsync(path)


def _write_manifest(path: Path, manifest: dict) -> None:
    fd = atomic.create(path)
    try:
        atomic.write_all(fd, json.dumps(manifest, indent=1).encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def save(ckpt_dir: Path, weights: dict, history: dict, optimizer: dict, state: dict, keep: int) -> Path:
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / f"step_{state['version']:06d}"
    try:
        with atomic.new_dir(final) as tmp:
            _safetensors_save({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
            flat, aliases = _flatten_history(history)
            _safetensors_save(flat or {"empty": torch.zeros(0)}, tmp / "history.safetensors",
                              {f"alias:{k}": held for k, held in aliases.items()} or None)
            _torch_save(optimizer, tmp / "optimizer.pt")
            _torch_save(state, tmp / "state.pt")
            manifest = {"version": state["version"], "sha256": {name: _sha256(tmp / name, final) for name in FILES},
                        "bytes": {name: os.path.getsize(tmp / name) for name in FILES}}
            _write_manifest(tmp / MANIFEST, manifest)
    except OSError as e:  # a full disk: the half-written folder is gone, every earlier checkpoint is untouched
        if e.errno is None:
            raise
        kept = latest(ckpt_dir)
        kept = f"the last checkpoint, {kept.name}, is kept" if kept else "no earlier checkpoint to keep"
        raise OSError(e.errno, f"{e.strerror} while writing checkpoint {final.name} ({kept})", str(ckpt_dir)) from None
    _known_good[final] = _identity(final)
    _rotate(ckpt_dir, final, keep)
    return final


def _rotate(ckpt_dir: Path, final: Path, keep: int) -> None:
    """Keep `final` and the keep - 1 newest intact checkpoints before it; remove the folders older than those.
    A damaged or foreign checkpoint is never counted as kept, so it cannot push a good one out; newer ones
    (damaged ones a resume skipped) are left to be replaced as the run reaches them; symlinks are never
    followed or removed."""
    kept = 1
    for path in checkpoints(ckpt_dir):
        if _step(path) >= _step(final) or os.path.islink(path) or not path.is_dir():
            continue
        if kept >= keep:
            shutil.rmtree(path, ignore_errors=True)
            _known_good.pop(path, None)
        elif _intact(path):
            kept += 1


# -- loading ---------------------------------------------------------------------------------------------

def load(path: Path) -> tuple[dict, dict, dict, dict]:
    """(weights, history, optimizer state, trainer state); CorruptCheckpoint if any part fails."""
    path = Path(path)
    verify(path)
    try:
        weights = load_file(path / "model.safetensors")
        flat = load_file(path / "history.safetensors")
        with safe_open(path / "history.safetensors", "pt") as f:
            aliases = {k.removeprefix("alias:"): held for k, held in (f.metadata() or {}).items() if k.startswith("alias:")}
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
        state = torch.load(path / "state.pt", weights_only=True)
    except OSError as e:
        raise CorruptCheckpoint(f"checkpoint {path}: cannot read it ({e.strerror or e})") from None
    except (pickle.UnpicklingError, SafetensorError, RuntimeError, EOFError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpoint(f"checkpoint {path}: refused to load ({first[:200]})") from None
    for name, value in (("optimizer.pt", optimizer), ("state.pt", state)):
        if not isinstance(value, dict):
            raise CorruptCheckpoint(f"checkpoint {path}: {name} holds {type(value).__name__}, not a table")
    flat.pop("empty", None)
    _known_good[path] = _identity(path)
    return weights, _unflatten_history(flat, aliases, path), optimizer, state


def _clean_leftovers(ckpt_dir: Path, warn) -> None:
    """Remove what a save killed midway left (.step_N.tmp-*), and put back a checkpoint that a killed
    replacement left aside (.step_N.old-* with no step_N)."""
    removed, restored = [], []
    for name in sorted(os.listdir(ckpt_dir)):
        if not (atomic.is_leftover(name) and _NAME.fullmatch(name[1:].rpartition(".")[0])):
            continue
        path, target = ckpt_dir / name, ckpt_dir / name[1:].rpartition(".")[0]
        if ".old-" in name and not os.path.islink(path) and path.is_dir() and not os.path.lexists(target):
            os.rename(path, target)
            restored.append(target.name)
            continue
        if os.path.islink(path) or not path.is_dir():
            os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    if restored:
        warn(f"resume: put back checkpoint(s) {', '.join(restored)}, left aside by a save that was interrupted")
    if removed:
        warn(f"resume: removed {len(removed)} half-written checkpoint folder(s) left by an interrupted save "
             f"({', '.join(removed)})")


def load_latest(ckpt_dir: Path, warn=print, check=None) -> tuple[Path, tuple[dict, dict, dict, dict]] | None:
    """The newest checkpoint that loads (and passes `check(path, loaded)`, which raises CorruptCheckpoint),
    warning about each damaged newer one; None when there is none at all."""
    ckpt_dir = Path(ckpt_dir)
    if not os.path.lexists(ckpt_dir):
        return None
    st = os.lstat(ckpt_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise CorruptCheckpoint(f"{ckpt_dir} is {_kind(ckpt_dir, st)}, not a folder of this run: a run's checkpoints "
                                "are read only from inside its run directory; move them there, then resume")
    _clean_leftovers(ckpt_dir, warn)
    found = checkpoints(ckpt_dir)
    for path in found:
        try:
            loaded = load(path)
            if check is not None:
                check(path, loaded)
            return path, loaded
        except CorruptCheckpoint as e:
            warn(f"warning: {e}; falling back to the previous checkpoint")
    if found:
        raise CorruptCheckpoint(f"{ckpt_dir}: none of its {len(found)} checkpoints is intact; start a new run in another run_dir")
    return None


# -- what a trainer's checkpoint must hold ---------------------------------------------------------------

class Tup:
    """A tuple (or list) of these forms, then optionally these."""

    def __init__(self, *forms, optional=()):
        self.forms, self.optional = forms, tuple(optional)


class Opt:
    """This form, or None."""

    def __init__(self, form):
        self.form = form


_ROW = Tup([int], [int], bytes, int, str, optional=(Opt(Tup(int, bytes)),))  # jobs.encode_completions
# Trainer.save's state.pt: key -> the form of its value. Forms: a type (float takes an int too), [form]: a list
# of them, {type: form}: a table of them, {"key": form, ...}: a table with at least these keys, Tup, Opt.
TRAINER_STATE = {
    "version": int, "counts": {str: int}, "lags": [int], "is_dev": {"values": [float], "n_nonfinite": int},
    "evals": [Tup(int, float)], "max_grad_norm": float,
    "pending": {int: Tup(int, int, [_ROW], float, optional=({str: object}, [str]))},  # then its job's answers
    "torch_rng": torch.Tensor, "elapsed": float,
}


def _mismatch(value, form, where: str) -> str | None:
    """Where `value` departs from `form` (see TRAINER_STATE), or None."""
    if form is object:
        return None
    if form is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"{where} is {type(value).__name__}, not a number"
    if isinstance(form, type):
        ok = isinstance(value, form) and not (form is int and isinstance(value, bool))
        return None if ok else f"{where} is {type(value).__name__}, not {form.__name__}"
    if isinstance(form, Opt):
        return None if value is None else _mismatch(value, form.form, where)
    if isinstance(form, list):
        if not isinstance(value, (list, tuple)):
            return f"{where} is {type(value).__name__}, not a list"
        return next((m for i, v in enumerate(value) if (m := _mismatch(v, form[0], f"{where}[{i}]"))), None)
    if isinstance(form, Tup):
        n, m = len(form.forms), len(form.forms) + len(form.optional)
        if not isinstance(value, (list, tuple)) or not n <= len(value) <= m:
            return f"{where} is not a tuple of {n}" + (f" to {m}" if m > n else "")
        forms = form.forms + form.optional
        return next((m for i, v in enumerate(value) if (m := _mismatch(v, forms[i], f"{where}[{i}]"))), None)
    if not isinstance(value, dict):
        return f"{where} is {type(value).__name__}, not a table"
    if len(form) == 1 and isinstance(next(iter(form)), type):  # {type: form}: every key and value
        (key, sub), = form.items()
        for k, v in value.items():
            if m := _mismatch(k, key, f"{where} key {k!r}") or _mismatch(v, sub, f"{where}[{k!r}]"):
                return m
        return None
    for k, sub in form.items():
        if k not in value:
            return f"{where} has no {k!r}"
        if m := _mismatch(value[k], sub, f"{where}[{k!r}]"):
            return m
    return None


def check_trainer_state(path: Path, state: dict) -> None:
    """CorruptCheckpoint unless `state` (state.pt) holds every part a trainer restores, of the right type."""
    problem = _mismatch(state, TRAINER_STATE, "state.pt")
    if problem is None:
        if state["version"] != _step(path):
            problem = f"state.pt is of update {state['version']}, not {_step(path)}"
        elif not state["evals"]:
            problem = "state.pt holds no held-out evaluation"
        elif any(lag < 0 for lag in state["lags"]):
            problem = "state.pt holds a negative lag"
        elif state["torch_rng"].dtype != torch.uint8 or state["torch_rng"].dim() != 1:
            problem = "state.pt['torch_rng'] is not a random generator state (uint8 vector)"
        elif not all(math.isfinite(float(x)) for x in (state["elapsed"], state["max_grad_norm"])):
            problem = "state.pt holds a non-finite time or gradient norm"
        elif (u := next((u for u, r in state["pending"].items() if len(r) > 5 and len(r[5]) != len(r[2])), None)) is not None:
            problem = f"state.pt['pending'][{u}] holds {len(state['pending'][u][5])} answers for {len(state['pending'][u][2])} completions"
    if problem is not None:
        raise CorruptCheckpoint(f"checkpoint {path}: {problem} (damaged, or not written by this trainer)")


def check_weights(path: Path, weights: dict, shapes: dict[str, tuple], what: str = "model.safetensors") -> None:
    """CorruptCheckpoint unless `weights` has exactly the tensors `shapes` names, of those shapes."""
    missing, extra = sorted(set(shapes) - set(weights)), sorted(set(weights) - set(shapes))
    if missing or extra:
        found = f"lacks {missing[0]!r}" if missing else f"has an unexpected {extra[0]!r}"
        raise CorruptCheckpoint(f"checkpoint {path}: {what} {found} (not a checkpoint of this model)")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != tuple(shape):
            raise CorruptCheckpoint(f"checkpoint {path}: {what} {name!r} has shape {tuple(weights[name].shape)}, "
                                    f"not {tuple(shape)} (not a checkpoint of this model)")
