"""Configuration: conf/default.yaml, an optional --config file, and NeMo-style key=value overrides.

load() merges them, checks every key against nemo_rz.schema, and for resume=RUN starts from the run's own
config.yaml: a change that the checkpoint cannot honour (model shape, task, seed, max_lag...) is refused,
any other change is applied and reported. Nothing is written here.

Files are read only when they are regular files of at most MAX_CONFIG_BYTES (never /dev/zero, a FIFO...), as
YAML whose aliases expand to at most MAX_YAML_NODES values. Interpolations: a --config file may refer to its own
keys (${algo.lr}) and call the resolvers that read only the config (CONFIG_ONLY_RESOLVERS); ${oc.env:...} or
any other resolver there is refused unless the user sets NEMO_RZ_ALLOW_CONFIG_ENV=1 (its value would be
written, resolved, into the run's config.yaml). The command line is the user's own and may use any. A run's
config.yaml is written resolved, so an interpolation there (an edited file) is refused.
"""
from __future__ import annotations

import difflib
import os
import stat
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
OPEN_KEYS = ("task.options", "algo.correction_params", "model.extra")  # free-form: to the task / correction / DecoderConfig
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


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few kB: anything past 1 MiB is not one
MAX_YAML_NODES = 10_000  # values once YAML aliases are expanded (conf/default.yaml has ~100): an alias bomb stops here
MAX_YAML_DEPTH = 32  # nesting levels (conf/default.yaml has 3)


def open_regular(path, what: str, max_bytes: int, hint: str = "give the path of a file"):
    """A binary file object of a regular file of at most max_bytes; anything else (missing, a directory, a device
    such as /dev/zero, a FIFO, a socket, too large, unreadable) is one ConfigError naming it. Never blocks: a FIFO
    is opened non-blocking, then refused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e}); {hint}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("Is a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                    "a socket" if stat.S_ISSOCK(st.st_mode) else
                    "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a special file")
            reason = kind if kind == "Is a directory" else f"{kind}, not a regular file"
            raise ConfigError(f"{what} {path}: cannot read it ({reason}); {hint}")
        if st.st_size > max_bytes:
            raise ConfigError(f"{what} {path}: {st.st_size} bytes, more than the {max_bytes} allowed for it; {hint}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path, what: str, max_bytes: int, hint: str = "give the path of a file") -> bytes:
    """The bytes of a regular file of at most max_bytes (open_regular)."""
    with open_regular(path, what, max_bytes, hint) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise ConfigError(f"{what} {path}: cannot read it ({e.strerror or e}); {hint}") from None
    if len(data) > max_bytes:  # it grew while read
        raise ConfigError(f"{what} {path}: more than the {max_bytes} bytes allowed for it; {hint}")
    return data


def _yaml_error(e: Exception, what: str, path, text: str = "") -> ConfigError:
    """One line for any YAML problem: what, the file, line and column, and what to do."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML does not allow: a position, not a mark
        line = text[:e.position].count("\n") + 1
        column = e.position - (text.rfind("\n", 0, e.position) + 1) + 1
        char = e.character if isinstance(e.character, int) else ord(e.character[:1] or "\0")
        return ConfigError(f"{what} {path}: not valid YAML (character U+{char:04X} is not allowed, at line {line}, "
                           f"column {column}); fix the file")
    reason = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    if context and getattr(e, "problem", None):
        reason = f"{context}, {reason}"  # PyYAML's own order: "while parsing X", then what it found
    reason = " ".join(str(reason).split())
    return ConfigError(f"{what} {path}: not valid YAML ({reason}{at}); fix the file")


def _expanded_size(node, what: str, path) -> None:
    """Refuse a YAML document that its aliases expand past MAX_YAML_NODES values, or nests past MAX_YAML_DEPTH."""
    sizes: dict[int, int] = {}

    def size(n, depth: int) -> int:
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(f"{what} {path}: nested deeper than {MAX_YAML_DEPTH} levels (at line "
                              f"{n.start_mark.line + 1}); a config is a mapping of a few levels, like conf/default.yaml")
        if id(n) in sizes:
            if sizes[id(n)] < 0:
                raise ConfigError(f"{what} {path}: a YAML alias refers to itself (at line {n.start_mark.line + 1}); "
                                  "write the values out")
            return sizes[id(n)]
        sizes[id(n)] = -1
        children = n.value if isinstance(n.value, list) else []
        total = 1
        for c in children:
            for part in (c if isinstance(c, tuple) else (c,)):
                total += size(part, depth + 1)
                if total > MAX_YAML_NODES:
                    raise ConfigError(f"{what} {path}: expands to more than {MAX_YAML_NODES} values (YAML aliases "
                                      "repeating others, an alias bomb?); write a config of the keys in conf/default.yaml")
        sizes[id(n)] = total
        return total

    size(node, 0)


def read_yaml(path: Path, what: str) -> DictConfig:
    """A YAML mapping from a regular file; any problem (unreadable, too large, not YAML, an alias bomb, not a
    mapping) is one ConfigError naming the file (and the line, for YAML errors)."""
    data = read_regular(path, what, MAX_CONFIG_BYTES, "give a YAML file like conf/default.yaml")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path}: cannot read it (not a UTF-8 text file)") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)  # the node graph: aliases are not expanded yet
    except yaml.YAMLError as e:
        raise _yaml_error(e, what, path, text) from None
    except RecursionError:
        raise ConfigError(f"{what} {path}: nested too deeply to read; a config is a mapping of a few levels, like "
                          "conf/default.yaml") from None
    if node is None:
        return OmegaConf.create({})
    _expanded_size(node, what, path)
    if not isinstance(node, yaml.MappingNode):
        try:
            found = type(yaml.safe_load(text)).__name__
        except (yaml.YAMLError, RecursionError):
            found = node.id
        raise ConfigError(f"{what} {path}: expected a mapping of keys like conf/default.yaml, found a {found}")
    try:
        return OmegaConf.create(text)  # OmegaConf's own loader (e.g. 1e-3 is a float there; duplicate keys refused)
    except yaml.YAMLError as e:
        raise _yaml_error(e, what, path, text) from None
    except OmegaConfBaseException as e:
        reason = " ".join(str(e).split("\n")[0].split()) or type(e).__name__
        raise ConfigError(f"{what} {path}: cannot read it as a config ({reason}); fix the file") from None
    except RecursionError:
        raise ConfigError(f"{what} {path}: nested too deeply to read; fix the file") from None


# -- interpolations ----------------------------------------------------------------------------------------------
# ${key} refers to another key of the config: a --config file may use it. A resolver call ${name:...} may read
# something else (oc.env the environment, a plugin's resolver anything): from a file, only the resolvers below,
# which read the config alone, unless the user sets ALLOW_ENV=1. The command line is the user's own: anything goes.
ALLOW_ENV = "NEMO_RZ_ALLOW_CONFIG_ENV"
CONFIG_ONLY_RESOLVERS = ("oc.select", "oc.decode", "oc.create", "oc.deprecated", "oc.dict.keys", "oc.dict.values")


def _strings(node, prefix=""):
    """(dotted key, string) of every string value in plain data (interpolations unresolved)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _strings(v, f"{prefix[:-1]}[{i}].")
    elif isinstance(node, str):
        yield prefix[:-1], node


def _raw(layer: DictConfig) -> dict:
    return OmegaConf.to_container(layer, resolve=False)


def _parsed(text: str):
    """OmegaConf's parse tree of a string value; None when it does not parse (resolving it fails later, with its
    own message)."""
    from omegaconf import grammar_parser

    try:
        return grammar_parser.parse(text)
    except Exception:  # GrammarParseError, or anything antlr raises on odd text
        return None


def _nodes(tree):
    stack = [tree] if tree is not None else []
    while stack:
        n = stack.pop()
        yield n
        stack.extend(getattr(n, "children", None) or [])


def _resolvers(text: str) -> list[str]:
    """The resolver names a string calls ("${...}" for a name that is itself computed)."""
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Parser

    return ["${...}" if n.interpolation() else n.getText()
            for n in _nodes(_parsed(text)) if isinstance(n, Parser.ResolverNameContext)]


def _is_interpolation(text: str) -> bool:
    """Whether a string holds an interpolation (an escaped \\${...} is text; one that does not parse counts)."""
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Parser

    if "${" not in text:
        return False
    tree = _parsed(text)
    return tree is None or any(isinstance(n, Parser.InterpolationContext) for n in _nodes(tree))


def _allow_env() -> bool:
    return os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true", "yes")


def _check_file_interpolations(layer: DictConfig, where: str) -> None:
    """A --config file may refer to its own keys (${algo.lr}) and call config-only resolvers; reading the
    environment (${oc.env:...}) or any other resolver needs the user's ALLOW_ENV=1."""
    if _allow_env():
        return
    for key, text in _strings(_raw(layer)):
        if "${" not in text:
            continue
        for name in _resolvers(text):
            if name not in CONFIG_ONLY_RESOLVERS:
                shown = text if len(text) <= 60 else text[:57] + "..."
                reads = "reads the environment" if name == "oc.env" else f"calls the resolver {name}, which may read outside the config"
                raise ConfigError(f"{where}: {key} = {shown!r} {reads}; a config file may only refer to its own keys "
                                  f"(its value would be written into the run's config.yaml): write the value, give it "
                                  f"on the command line, or set {ALLOW_ENV}=1 to allow it")


def _check_saved_interpolations(saved: DictConfig, where) -> None:
    """A run's config.yaml is written resolved: an interpolation there means it was edited."""
    for key, text in _strings(_raw(saved)):
        if _is_interpolation(text):
            shown = text if len(text) <= 60 else text[:57] + "..."
            raise ConfigError(f"resume: {where}: {key} = {shown!r} is an interpolation, but a run's config.yaml is "
                              "written with every value resolved (it was edited); write the value itself")


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
        _check_file_interpolations(layer, f"--config {config_file}")
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
    _check_saved_interpolations(saved, saved_path)
    try:
        before = schema.validate(_merge(default, saved), machine=False)  # this machine's limits: checked below
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
