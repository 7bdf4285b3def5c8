"""Configuration: conf/default.yaml, an optional --config file, and NeMo-style key=value overrides."""
from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

_HERE = Path(__file__).resolve().parent
# conf/ sits beside the package in a checkout and inside it (nemo_rz/conf) once installed from a wheel
CONF_DIR = _HERE / "conf" if (_HERE / "conf" / "default.yaml").is_file() else _HERE.parent / "conf"
DEFAULT = CONF_DIR / "default.yaml"
OPEN_KEYS = ("task.options", "algo.correction_params")  # free-form: passed through to the task / correction


def _keys(cfg, prefix="") -> list[str]:
    out = []
    for k, v in cfg.items():
        path = f"{prefix}{k}"
        out.append(path)
        if isinstance(v, DictConfig) and path not in OPEN_KEYS:
            out += _keys(v, path + ".")
    return out


def _check_keys(given, valid: list[str], where: str) -> None:
    for key in _keys(given):
        if key in valid or any(key.startswith(o + ".") for o in OPEN_KEYS):
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"unknown config key {key!r} in {where}{hint}")


def load(config_file: str | None = None, overrides: list[str] = ()) -> DictConfig:
    cfg = OmegaConf.load(DEFAULT)
    valid = _keys(cfg)
    layers = []
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ValueError(f"--config {config_file}: no such file; give a YAML file like conf/default.yaml")
        layer = OmegaConf.load(path)
        if isinstance(layer, ListConfig):
            raise ValueError(f"--config {config_file}: expected a mapping of keys, found a list")
        _check_keys(layer, valid, config_file)
        layers.append(layer)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: write key=value, e.g. algo.max_lag=8")
    dot = OmegaConf.from_dotlist(list(overrides))
    _check_keys(dot, valid, "the command line")
    layers.append(dot)
    return OmegaConf.merge(cfg, *layers)
