"""Configuration: conf/default.yaml, an optional --config file, and NeMo-style key=value overrides.

load() merges them, checks every key against nemo_rz.schema, and for resume=RUN starts from the run's own
config.yaml: a change that the checkpoint cannot honour (model shape, task, seed, max_lag...) is refused,
any other change is applied and reported. Nothing is written here.
"""
from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_rz import schema
from nemo_rz.errors import ConfigError

_HERE = Path(__file__).resolve().parent
# conf/ sits beside the package in a checkout and inside it (nemo_rz/conf) once installed from a wheel
CONF_DIR = _HERE / "conf" if (_HERE / "conf" / "default.yaml").is_file() else _HERE.parent / "conf"
DEFAULT = CONF_DIR / "default.yaml"
OPEN_KEYS = ("task.options", "algo.correction_params")  # free-form: passed through to the task / correction
RUN_CONFIG = "config.yaml"  # the resolved config a run directory keeps


def _keys(cfg, prefix="") -> dict[str, bool]:
    """Every dotted key (not resolving interpolations) -> whether it is a section of keys."""
    out = {}
    for k, v in cfg.items_ex(resolve=False):
        path = f"{prefix}{k}"
        out[path] = isinstance(v, DictConfig) and path not in OPEN_KEYS
        if out[path]:
            out.update(_keys(v, path + "."))
    return out


def _check_keys(given, default: DictConfig, where: str) -> None:
    valid = _keys(default)
    for key, is_section in _keys(given).items():
        if key in valid:
            if valid[key] and not is_section:
                example = next(k for k in valid if k.startswith(key + "."))
                raise ConfigError(f"config key {key!r} in {where} is a section: set the keys inside it, e.g. {example}=...")
            continue
        if any(key.startswith(o + ".") for o in OPEN_KEYS):
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigError(f"unknown config key {key!r} in {where}{hint}")


def preset_path(name: str) -> Path:
    """--config: a YAML file, or the name of a preset shipped with the package (e.g. smollm2_arith)."""
    path = Path(name)
    if not path.exists() and path.parent == Path(".") and (CONF_DIR / f"{path.stem}.yaml").is_file():
        return CONF_DIR / f"{path.stem}.yaml"
    return path


def read_yaml(path: Path, what: str) -> DictConfig:
    """A YAML mapping from a file; any problem (unreadable, not YAML, not a mapping) is one ConfigError."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else "not a UTF-8 text file"
        raise ConfigError(f"{what} {path}: cannot read it ({reason})") from None
    try:
        shape = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{what} {path}: not valid YAML ({getattr(e, 'problem', None) or e}{at}); fix the file") from None
    if shape is None:
        return OmegaConf.create({})
    if not isinstance(shape, dict):
        raise ConfigError(f"{what} {path}: expected a mapping of keys like conf/default.yaml, found a {type(shape).__name__}")
    return OmegaConf.create(text)  # parsed again by OmegaConf's own loader (e.g. 1e-3 is a float there)


def _merge(*layers) -> DictConfig:
    try:
        return OmegaConf.merge(*layers)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config: cannot merge {getattr(e, 'full_key', '') or 'the layers'} ({str(e).splitlines()[0]})") from None


def _overrides(items, default: DictConfig) -> DictConfig:
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: write key=value, e.g. algo.max_lag=8")
    try:
        dot = OmegaConf.from_dotlist(list(items))
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"overrides {' '.join(items)}: cannot parse them ({str(e).splitlines()[0]})") from None
    _check_keys(dot, default, "the command line")
    return dot


def load(config_file: str | None = None, overrides=(), log=None) -> DictConfig:
    """The validated, resolved config; with resume=RUN, RUN's config with these changes (reported to `log`)."""
    default = read_yaml(DEFAULT, "default config")
    layers = []
    if config_file:
        layer = read_yaml(preset_path(config_file), "--config")
        _check_keys(layer, default, config_file)
        layers.append(layer)
    layers.append(_overrides(overrides, default))
    cfg = _merge(default, *layers)
    given = schema.resolved(cfg)
    if not given.get("resume"):
        return schema.validate(cfg)
    return _resumed(str(given["resume"]), given.get("run_dir"), default, layers, log)


def _resumed(resume: str, given_run_dir, default: DictConfig, layers: list, log) -> DictConfig:
    run_dir = Path(resume)
    saved_path = run_dir / RUN_CONFIG
    if not saved_path.is_file():
        raise ConfigError(f"resume={resume}: {saved_path} not found; point resume at a run directory made by nemo_rz.train")
    saved = read_yaml(saved_path, "resume: run config")
    _check_keys(saved, default, str(saved_path))
    try:
        before = schema.validate(_merge(default, saved))
    except ConfigError as e:
        raise ConfigError(f"resume: {saved_path}: {e}") from None
    if given_run_dir is not None and Path(str(given_run_dir)) != run_dir:
        raise ConfigError(f"resume={resume} continues that run in place: drop run_dir={given_run_dir}")
    cfg = _merge(before, *layers)
    cfg.resume = cfg.run_dir = str(run_dir)
    cfg = schema.validate(cfg)
    for key in schema.SCHEMA:
        old, new = OmegaConf.select(before, key), OmegaConf.select(cfg, key)
        if key in ("resume", "run_dir") or old == new:
            continue
        if schema.fixed_on_resume(key):
            raise ConfigError(f"resume={resume}: {key} was {_plain(old)}, now {_plain(new)}; a resumed run keeps it "
                              "(its checkpoints depend on it): drop the change or start a new run_dir")
        if log is not None:
            log(f"resume: {key} {_plain(old)} -> {_plain(new)}")
    return cfg


def _plain(value) -> str:
    if isinstance(value, DictConfig):
        return str(OmegaConf.to_container(value))
    return "null" if value is None else str(value)
