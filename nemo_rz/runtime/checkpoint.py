"""Checkpoints: weights (safetensors), recent weight versions, optimizer, RNG, and queue state.

Written to a temporary directory and renamed into place, so an interrupted save never damages the last
good checkpoint. A manifest holds each file's SHA-256: a checkpoint whose files do not match it (truncated,
corrupted or edited) is skipped for the newest intact one. Nothing is unpickled: tensors come from
safetensors, optimizer and trainer state from torch.load(weights_only=True), which builds only tensors and
plain containers, so a pickle planted in a run directory cannot run code.
"""
from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from nemo_rz import atomic

MANIFEST = "manifest.json"
FILES = ("model.safetensors", "history.safetensors", "optimizer.pt", "state.pt")


class CorruptCheckpoint(ValueError):
    pass


def _flatten_history(history: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"v{v}/{k}": t.contiguous() for v, sd in history.items() for k, t in sd.items()}


def _unflatten_history(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        v, name = key.split("/", 1)
        out.setdefault(int(v[1:]), {})[name] = t
    return out


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint directories, newest first (intact or not)."""
    found = [p for p in Path(ckpt_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=_step, reverse=True)


def save(ckpt_dir: Path, weights: dict, history: dict, optimizer: dict, state: dict, keep: int) -> Path:
    final = Path(ckpt_dir) / f"step_{state['version']:06d}"
    with atomic.new_dir(final) as tmp:
        save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
        save_file(_flatten_history(history) or {"empty": torch.zeros(0)}, tmp / "history.safetensors")
        torch.save(optimizer, tmp / "optimizer.pt")
        torch.save(state, tmp / "state.pt")
        manifest = {"version": state["version"], "sha256": {name: _sha256(tmp / name) for name in FILES}}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for old in checkpoints(ckpt_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def verify(path: Path) -> None:
    """Raise CorruptCheckpoint unless every file matches the manifest's checksum."""
    if not (path / MANIFEST).is_file():
        raise CorruptCheckpoint(f"checkpoint {path}: no {MANIFEST} (incomplete, or written before checkpoints had checksums)")
    try:
        expected = json.loads((path / MANIFEST).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"checkpoint {path}: unreadable {MANIFEST} ({type(e).__name__})") from None
    for name in FILES:
        try:
            ok = _sha256(path / name) == expected.get(name)
        except OSError as e:
            raise CorruptCheckpoint(f"checkpoint {path}: cannot read {name} ({e.strerror})") from None
        if not ok:
            raise CorruptCheckpoint(f"checkpoint {path}: {name} does not match its checksum (truncated or modified)")


def latest(ckpt_dir: Path) -> Path | None:
    """The newest intact checkpoint."""
    for path in checkpoints(ckpt_dir):
        try:
            verify(path)
            return path
        except CorruptCheckpoint:
            continue
    return None


def load(path: Path) -> tuple[dict, dict, dict, dict]:
    """(weights, history, optimizer state, trainer state); CorruptCheckpoint if any part fails."""
    verify(path)
    try:
        weights = load_file(path / "model.safetensors")
        flat = load_file(path / "history.safetensors")
        optimizer = torch.load(path / "optimizer.pt", weights_only=True)
        state = torch.load(path / "state.pt", weights_only=True)
    except (pickle.UnpicklingError, SafetensorError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptCheckpoint(f"checkpoint {path}: refused to load ({first[:200]})") from None
    flat.pop("empty", None)
    return weights, _unflatten_history(flat), optimizer, state


def load_latest(ckpt_dir: Path, warn=print) -> tuple[Path, tuple[dict, dict, dict, dict]] | None:
    """The newest checkpoint that loads, warning about each damaged newer one; None when there is none at all."""
    found = checkpoints(ckpt_dir)
    for path in found:
        try:
            return path, load(path)
        except CorruptCheckpoint as e:
            warn(f"warning: {e}; falling back to the previous checkpoint")
    if found:
        raise CorruptCheckpoint(f"{ckpt_dir}: none of its {len(found)} checkpoints is intact; start a new run in another run_dir")
    return None
