"""Checkpoints: weights (safetensors), recent weight versions, optimizer, RNG, and queue state.

Written to a temporary directory and renamed into place, so an interrupted save never damages the last
good checkpoint.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _flatten_history(history: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {f"v{v}/{k}": t.contiguous() for v, sd in history.items() for k, t in sd.items()}


def _unflatten_history(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        v, name = key.split("/", 1)
        out.setdefault(int(v[1:]), {})[name] = t
    return out


def save(ckpt_dir: Path, weights: dict, history: dict, optimizer: dict, state: dict, keep: int) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step_{state['version']:06d}"
    tmp = ckpt_dir / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / "model.safetensors")
    save_file(_flatten_history(history) or {"empty": torch.zeros(0)}, tmp / "history.safetensors")
    torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(ckpt_dir.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(ckpt_dir: Path) -> Path | None:
    found = sorted(p for p in ckpt_dir.glob("step_*") if (p / "state.pt").exists())
    return found[-1] if found else None


def load(path: Path) -> tuple[dict, dict, dict, dict]:
    """(weights, history, optimizer state, trainer state)."""
    weights = load_file(path / "model.safetensors")
    flat = load_file(path / "history.safetensors")
    flat.pop("empty", None)
    optimizer = torch.load(path / "optimizer.pt", weights_only=False)
    state = torch.load(path / "state.pt", weights_only=False)
    return weights, _unflatten_history(flat), optimizer, state
