"""Every configuration key's type, valid range, and whether a resumed run may change it: declared once, here.

validate(cfg) checks a merged config before any work and returns it resolved (interpolations replaced, ints
given for floats made floats); the first bad key raises ConfigError naming the key, its value and what is
valid, in a fraction of a second: nothing here imports torch. Losses, corrections and tasks are the names
registered through nemo_rz.plugins (package metadata only, read after the plain checks, so a plugin's name
validates); the small fixed sets that code also checks (kernel sets, dtypes) are written out here, and
tests/test_config.py checks them against the code's own tuples.

Then check_sizes() holds every size against what the model (heads, KV heads, MLP features, positions), the
other settings and this machine (usable_cpus(), available_memory(): a lower bound on the run's memory) allow,
and task.options are checked against the task's declared options (nemo_rz.tasks.options): all before any
process starts.

typed(cfg) gives a validated config as a Config of frozen dataclasses, one per section, whose fields are
SCHEMA's keys (derived from it: no second list): components take their own section, and a misspelt attribute
raises.

A new key: add it to conf/default.yaml (with a comment) and a line to SCHEMA; tests/test_config.py checks
that the two agree and that the defaults pass.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_rz import plugins
from nemo_rz.errors import ConfigError

MAX_SEED = 99_999_999  # rollout seeds are (seed * 1_000_003 + update) * 65_536 + i: must stay below 2**64


@dataclasses.dataclass(frozen=True)
class Key:
    kind: str  # int | float | bool | str | choice | mapping | ints (a list of integers, each in range)
    lo: float | None = None  # inclusive, or exclusive when lo_open
    hi: float | None = None
    lo_open: bool = False
    choices: tuple | Callable[[], tuple] | None = None  # a callable is a registry, read when checked
    optional: bool = False  # null allowed
    null_means: str = ""  # what null does, for the error message
    why: str = ""  # the reason for a range that is not obvious
    fixed: bool = False  # a resumed run may not change it (the checkpoint depends on it)

    def expected(self) -> str:
        if self.kind == "choice":
            text = "one of " + ", ".join(map(_show, self._choices()))
        elif self.kind in ("int", "float"):
            noun = "an integer" if self.kind == "int" else "a finite number"
            if self.lo is not None and self.hi is not None:
                text = f"{noun} in {self.lo}..{self.hi}"
            elif self.lo is not None:
                text = f"{noun} {'>' if self.lo_open else '>='} {self.lo}"
            else:
                text = noun
        else:
            text = {"bool": "true or false", "str": "a string", "mapping": "a mapping of keys",
                    "ints": f"a non-empty list of integers >= {self.lo}"}[self.kind]
        if self.optional:
            text += f", or null{' ' + self.null_means if self.null_means else ''}"
        return text + (f" ({self.why})" if self.why else "")

    def _choices(self) -> tuple:
        return self.choices() if callable(self.choices) else self.choices

    def hint(self, value: Any) -> str:
        """ " (did you mean X?)" for a misspelt choice, else "". """
        words = [c for c in self._choices() if isinstance(c, str)] if self.kind == "choice" else []
        close = difflib.get_close_matches(str(value), words, n=1) if isinstance(value, str) else []
        return f" (did you mean {close[0]}?)" if close else ""

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str) or type(value) is int  # run_dir=2024 arrives as an int
        if self.kind == "mapping":
            return isinstance(value, dict)
        if self.kind == "ints":
            return (isinstance(value, list) and len(value) > 0
                    and all(type(v) is int and (self.lo is None or v >= self.lo) for v in value))
        if self.kind == "choice":
            return any(value == c and type(value) is type(c) for c in self._choices())
        if isinstance(value, bool) or not isinstance(value, int if self.kind == "int" else (int, float)):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def normalised(self, value: Any) -> Any:
        """An accepted value in its key's own type (an int given for a float becomes a float)."""
        if value is None:
            return None
        return float(value) if self.kind == "float" else str(value) if self.kind == "str" else value


def _show(choice) -> str:
    return str(choice).lower() if isinstance(choice, bool) else str(choice)


def _registered(kind: str) -> Callable[[], tuple]:
    return lambda: plugins.names(kind)


def Int(lo=None, hi=None, **kw) -> Key:
    return Key("int", lo, hi, **kw)


def Positive(**kw) -> Key:
    return Key("float", 0, lo_open=True, **kw)


def Choice(choices, **kw) -> Key:
    return Key("choice", choices=choices, **kw)


def Bool(**kw) -> Key:
    return Key("bool", **kw)


def Str(**kw) -> Key:
    return Key("str", **kw)


KERNEL_SETS = ("consistent", "fast")  # nemo_rz.ops.KERNELS
PRECISION_RECIPES = ("none", "bf16", "fp8_current", "fp8_block", "mxfp8", "mxfp4", "nvfp4")  # nemo_rz.quant.linear.PRECISIONS

SCHEMA: dict[str, Key] = {
    "seed": Int(0, MAX_SEED, fixed=True),
    "run_dir": Str(optional=True, null_means="for runs/<task>-<timestamp>"),
    "resume": Str(optional=True, null_means="for a new run"),
    "kernels": Choice(KERNEL_SETS),
    "progress": Bool(),
    "model.hf_path": Str(optional=True, null_means="for a fresh model", fixed=True),
    "model.tokenizer": Str(optional=True, null_means="for the checkpoint's own (hf_path) or the character one", fixed=True),
    "model.hidden_size": Int(1, fixed=True),
    "model.intermediate_size": Int(1, fixed=True),
    "model.num_layers": Int(1, fixed=True),
    "model.num_heads": Int(1, fixed=True),
    "model.num_kv_heads": Int(1, fixed=True),
    "model.qk_norm": Bool(fixed=True),
    "model.max_position_embeddings": Int(1, fixed=True),
    "model.sliding_window": Int(1, optional=True, null_means="for full attention in every layer", fixed=True),
    "model.sliding_window_pattern": Int(1, optional=True, null_means="for every layer sliding", fixed=True),
    "model.attention_sinks": Bool(fixed=True),
    "model.num_experts": Int(0, why="0 for a dense MLP", fixed=True),
    "model.num_experts_per_tok": Int(1, fixed=True),
    "model.moe_intermediate_size": Int(1, optional=True, null_means="for intermediate_size", fixed=True),
    "model.extra": Key("mapping", fixed=True),
    "task.name": Choice(_registered("task"), why="plugins add more: docs/plugins.md", fixed=True),
    "task.options": Key("mapping", fixed=True),
    "task.chat_template": Choice(("auto", True, False), fixed=True),
    "task.system_prompt": Str(optional=True, null_means="for none", fixed=True),
    "warmup.steps": Int(0, fixed=True),
    "warmup.batch_size": Int(1, fixed=True),
    "warmup.lr": Positive(fixed=True),
    "algo.updates": Int(1),
    "algo.max_lag": Int(0, 64, fixed=True, why="batch u is generated by weights u - max_lag"),
    "algo.prompts_per_update": Int(1, fixed=True),
    "algo.group_size": Int(2, fixed=True, why="with one sample per group every advantage r - mean(r) is 0"),
    "algo.lr": Positive(),
    "algo.grad_clip": Positive(optional=True, null_means="for no clipping"),
    "algo.temperature": Positive(fixed=True),
    "algo.max_new_tokens": Int(1),
    "algo.loss": Choice(_registered("loss"), why="plugins add more: docs/plugins.md"),
    "algo.correction": Choice(_registered("correction"), why="plugins add more: docs/plugins.md"),
    "algo.correction_params": Key("mapping"),
    "runtime.backend": Choice(("local", "ray")),
    "runtime.rollout_workers": Int(1),
    "runtime.worker_threads": Int(1),
    "runtime.learner_threads": Int(1),
    "runtime.rollout_kernels": Choice(KERNEL_SETS, optional=True, null_means="for the same as kernels"),
    "runtime.rollout_dtype": Choice(("float32", "bfloat16")),  # nemo_rz.models.config.DTYPES
    "runtime.crash_worker_at_batch": Int(-1, why="-1 = never"),
    "runtime.worker_heartbeat_s": Positive(why="seconds a rollout worker may stay silent before it is restarted"),
    "runtime.learner": Choice(("builtin", "megatron"), fixed=True, why="megatron needs the megatron extra"),
    "megatron.tp": Int(1, fixed=True, why="tensor-parallel ranks"),
    "megatron.pp": Int(1, fixed=True, why="pipeline stages (Megatron's schedule; must divide the model's layers)"),
    "megatron.cp": Int(1, fixed=True, why="context-parallel ranks (each sequence's tokens split over them)"),
    "megatron.ep": Int(1, fixed=True, why="expert-parallel ranks: the experts split over ep of the dp x cp ranks"),
    "megatron.dp": Int(1, optional=True, null_means="for the fewest that megatron.ep needs", fixed=True,
                       why="data-parallel ranks"),
    "megatron.grad_shares": Int(1, optional=True, null_means="for megatron.dp", fixed=True),
    "megatron.device": Choice(("cpu", "cuda"), why="cuda: rank r on cuda:LOCAL_RANK with NCCL"),
    "megatron.heartbeat_s": Positive(why="seconds a learner rank may stay silent (stopped, stuck) before the job is stopped"),
    "generation.backend": Choice(("builtin", "vllm")),
    "precision.recipe": Choice(PRECISION_RECIPES, why="fp8_delayed is not offered: its amax history of earlier "
                               "batches would make a token's bits depend on them"),
    "precision.modules": Choice(("all", "attention", "mlp", "experts")),
    "precision.activation_scaling": Choice(("row", "tensor"), why="tensor = TE's per-tensor amax, which breaks batch invariance"),
    "lora.rank": Int(0, fixed=True, why="0 = no adapters"),
    "lora.alpha": Positive(fixed=True),
    "lora.rslora": Bool(fixed=True),
    "lora.modules": Str(fixed=True, why="all, attention, mlp, experts, or comma-separated q_proj,k_proj,v_proj,o_proj,"
                        "gate_proj,up_proj,down_proj,experts.gate_up_proj,experts.down_proj (nemo_rz.models.lora)"),
    "lora.expert_a": Choice(("per_expert", "shared"), fixed=True, why="MoE experts: an A per expert, or one shared (B per expert)"),
    "lora.init_from": Str(optional=True, null_means="for a fresh adapter (B = 0)", fixed=True),
    "eval.every": Int(0, why="0 = only at the end"),
    "eval.n": Int(1),
    "draft.mode": Choice(("off", "cotrain", "frozen", False), fixed=True,  # nemo_rz.algorithms.draft.MODES
                         why="YAML reads a bare off as false, which means off too"),
    "draft.kind": Choice(("eagle", "mtp"), fixed=True, why="eagle = an EAGLE-3 head trained online; mtp = DeepSeek-V3's "
                         "multi-token-prediction layers (the checkpoint's, or fresh ones)"),
    "draft.aux_layers": Key("ints", 0, optional=True, null_means="for EAGLE-3's low, middle and high layers", fixed=True),
    "draft.num_layers": Int(1, fixed=True),
    "draft.vocab_size": Int(1, optional=True, null_means="for the target's whole vocabulary", fixed=True),
    "draft.steps": Int(1, why="training-time-test steps, each fed by the one before"),
    "draft.k": Int(1, 16, why="draft tokens proposed per target pass"),
    "draft.lr": Positive(),
    "draft.loss_weight": Positive(),
    "draft.checkpoint": Str(optional=True, null_means="for a fresh draft (draft.mode=frozen needs one)", fixed=True),
    "metrics.decomposition_every": Int(0, why="0 = never"),
    "metrics.tensorboard": Bool(),
    "metrics.wandb": Bool(why="a Weights & Biases run in RUN_DIR/wandb (offline unless WANDB_API_KEY or WANDB_MODE is set)"),
    "metrics.mlflow": Bool(why="an MLflow run (tracking store metrics.mlflow_uri)"),
    "metrics.project": Str(why="the W&B project and MLflow experiment"),
    "metrics.mlflow_uri": Str(optional=True, null_means="for file://RUN_DIR/mlruns (or MLFLOW_TRACKING_URI)"),
    "checkpoint.every": Int(0, why="0 = never"),
    "checkpoint.keep": Int(1),
    "export.on_finish": Bool(why="export the last checkpoint to RUN_DIR/export (nemo_rz.tools.export) when the run ends"),
}


# -- typed sections: SCHEMA's keys as frozen dataclasses, one per section ----------------------------------------
_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "mapping": dict, "ints": tuple[int, ...]}


def _field_type(spec: Key):
    if spec.kind != "choice":
        kind = _TYPES[spec.kind]
    elif callable(spec.choices):  # a registry: names
        kind = str
    else:
        kinds = tuple(dict.fromkeys(type(c) for c in spec.choices))
        kind = kinds[0] if len(kinds) == 1 else Union[kinds]
    return Optional[kind] if spec.optional else kind


def _config_class() -> type:
    """Config: the top-level keys, then a frozen dataclass per section (AlgoSection for algo.*, ...), from SCHEMA."""
    top, sections = [], {}
    for key, spec in SCHEMA.items():
        section, _, name = key.rpartition(".")
        if "." in section:
            raise TypeError(f"SCHEMA key {key}: typed sections are one level deep")
        (sections.setdefault(section, []) if section else top).append((name, _field_type(spec)))
    for section, fields in sections.items():
        top.append((section, _named(dataclasses.make_dataclass(f"{section.title()}Section", fields, frozen=True))))
    return _named(dataclasses.make_dataclass("Config", top, frozen=True))


def _named(cls: type) -> type:
    """A made class importable from this module by its name, so that a Config pickles."""
    cls.__module__ = __name__
    globals()[cls.__name__] = cls
    return cls


Config = _config_class()


def typed(cfg: DictConfig | dict) -> Config:
    """A validated config (validate's result) as a Config: each section a frozen dataclass whose fields are
    SCHEMA's keys, so a misspelt attribute raises AttributeError. Mappings are dicts, lists of ints tuples;
    a missing or bad value is one ConfigError, as in validate."""
    plain = cfg if isinstance(cfg, dict) else resolved(cfg)
    top, sections = {}, {}
    for key, spec in SCHEMA.items():
        value = _checked(plain, key, spec)
        value = dict(value) if spec.kind == "mapping" else tuple(value) if spec.kind == "ints" and value is not None else value
        section, _, name = key.rpartition(".")
        (sections.setdefault(section, {}) if section else top)[name] = value
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    return Config(**top, **{s: fields[s](**values) for s, values in sections.items()})


def _lookup(plain: dict, key: str):
    node = plain
    for part in key.split("."):
        node = node[part]
    return node


def _checked(plain: dict, key: str, spec: Key):
    """The value of `key` in `plain`, normalised; ConfigError (one line) when it is missing or not accepted."""
    try:
        value = _lookup(plain, key)
    except (KeyError, TypeError):
        raise ConfigError(f"config key {key} is missing; add it (see conf/default.yaml)") from None
    if not spec.accepts(value):
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{key} = {shown}: expected {spec.expected()}{spec.hint(value)}")
    return spec.normalised(value)


def _assign(plain: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    node = plain
    for part in parents:
        node = node[part]
    node[last] = value


def resolved(cfg: DictConfig) -> dict:
    """The config as plain data with interpolations replaced; a bad one raises ConfigError naming its key."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"config key {key}: cannot resolve its value ({reason})") from None


def validate(cfg: DictConfig, machine: bool = True) -> DictConfig:
    """Check every declared key (plain checks first, then registry-backed choices), then the sizes against the
    model and each other, and against this machine's cores and memory (machine=False: not those, e.g. for a
    saved run's config before this run's changes), then the task's options; return the config resolved."""
    plain = resolved(cfg)
    order = sorted(SCHEMA.items(), key=lambda kv: callable(kv[1].choices))
    for key, spec in order:
        _assign(plain, key, _checked(plain, key, spec))
    _derive_data_parallel(plain, note=machine)
    check_sizes(plain, machine)
    _check_task_options(plain)
    return OmegaConf.create(_literal(plain))


def data_parallel_size(meg: dict) -> int:
    """megatron.dp as given, or (null, the default) the fewest data-parallel ranks megatron.ep needs: experts
    are split over ep of the dp x cp ranks, so ep must divide dp x cp, and the fewest is ep / gcd(ep, cp) (1
    without expert parallelism). The one place dp is derived; what validate leaves in the config."""
    if meg["dp"] is not None:
        return meg["dp"]
    return meg["ep"] // math.gcd(meg["ep"], meg["cp"])


def _derive_data_parallel(plain: dict, note: bool) -> None:
    meg = plain["megatron"]
    given, meg["dp"] = meg["dp"], data_parallel_size(meg)
    if note and given is None and meg["dp"] > 1 and plain["runtime"]["learner"] == "megatron":
        print(f"note: megatron.ep = {meg['ep']}: experts are split over data-parallel ranks, so megatron.dp is "
              f"{meg['dp']}", file=sys.stderr)


def _literal(node):
    """Resolved values as OmegaConf text: a "${" that a value holds (e.g. from an escaped \\${ ) stays text, also
    once the config is written out and read back."""
    if isinstance(node, dict):
        return {k: _literal(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_literal(v) for v in node]
    if isinstance(node, str) and "${" in node:
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", node)
    return node


def _check_task_options(plain: dict) -> None:
    """task.options against the task's declared options (nemo_rz.tasks.options): types, ranges, names."""
    from nemo_rz.tasks import options

    task = plain["task"]
    fn = plugins.load("task", task["name"])
    try:
        task["options"] = options.check(task["name"], fn, task["options"])
    except options.OptionError as e:
        raise ConfigError(str(e)) from None


# -- sizes: against the model, each other and this machine ------------------------------------------------------
GIB = 1 << 30
CHAR_VOCAB = 46  # the character tokenizer's vocabulary (nemo_rz.tasks.tokenizer): the least a fresh model has


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, else os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read(64).split()[0])
    except (OSError, ValueError, IndexError):
        return None


def available_memory() -> int | None:
    """Bytes of memory this process can still use: /proc/meminfo's MemAvailable (else os.sysconf's available
    pages), lowered to what a cgroup memory limit leaves; None when unknown."""
    avail = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = min(avail, max(0, limit - used))
    return avail


@dataclasses.dataclass
class Shape:
    """What the sizes of a run depend on: the model's dimensions (a checkpoint's config.json with hf_path)."""
    hidden: int
    inter: int
    layers: int
    heads: int
    kv: int
    head_dim: int
    vocab: int
    positions: int
    experts: int = 0
    topk: int = 0
    moe_inter: int = 0
    tied: bool = False
    where: str = "model"  # how messages name its keys' source


def _hf_shape(hf_path: str) -> Shape | None:
    """A checkpoint directory's dimensions from its config.json, or None (a .gguf, unreadable, odd keys: the
    model loader reports those, with the file)."""
    path = Path(hf_path) / "config.json"
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    d = d.get("text_config", d) if isinstance(d, dict) else None
    if not isinstance(d, dict):
        return None

    def get(key, default=None):
        v = d.get(key, default)
        return v if type(v) is int and v > 0 else None

    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if hidden is None or heads is None:
        return None
    experts = get("num_experts") or get("num_local_experts") or 0
    shape = dict(hidden=hidden, inter=get("intermediate_size"), layers=get("num_hidden_layers"), heads=heads,
                 kv=get("num_key_value_heads", heads), head_dim=get("head_dim", hidden // heads), vocab=get("vocab_size"),
                 positions=get("max_position_embeddings"))
    if any(v is None for v in shape.values()):
        return None
    return Shape(**shape, experts=experts, topk=get("num_experts_per_tok") or 0,
                 moe_inter=get("moe_intermediate_size") or shape["inter"], tied=bool(d.get("tie_word_embeddings")),
                 where=f"{path}")


def model_shape(plain: dict) -> Shape | None:
    m = plain["model"]
    if m["hf_path"] is not None:
        return _hf_shape(str(m["hf_path"]))
    heads = m["num_heads"]
    return Shape(hidden=m["hidden_size"], inter=m["intermediate_size"], layers=m["num_layers"], heads=heads,
                 kv=m["num_kv_heads"], head_dim=m["hidden_size"] // heads, vocab=CHAR_VOCAB,
                 positions=m["max_position_embeddings"], experts=m["num_experts"], topk=m["num_experts_per_tok"],
                 moe_inter=m["moe_intermediate_size"] or m["intermediate_size"])


def _divisors(n: int) -> str:
    found = [d for d in range(1, min(n, 64) + 1) if n % d == 0]
    return ", ".join(map(str, found)) + (", ..." if n > 64 else "")


def _check_model(plain: dict) -> None:
    """A fresh model's dimensions fit each other (DecoderConfig checks the same, later, as a last resort)."""
    m = plain["model"]
    if m["hf_path"] is not None:
        return
    heads, kv, hidden = m["num_heads"], m["num_kv_heads"], m["hidden_size"]
    if heads % kv:
        raise ConfigError(f"model.num_kv_heads = {kv}: num_heads={heads} is not a multiple of num_kv_heads={kv}; "
                          f"choose num_kv_heads dividing num_heads (one of {_divisors(heads)})")
    head_dim = hidden // heads
    if head_dim < 2 or head_dim % 2:
        fits = [h for h in range(1, min(hidden, 4096) + 1) if (hidden // h) >= 2 and (hidden // h) % 2 == 0]
        most = f"; at most {max(fits)} heads for hidden_size {hidden}" if fits else ""
        raise ConfigError(f"model.num_heads = {heads}: head_dim = hidden_size // num_heads = {hidden} // {heads} = "
                          f"{head_dim}, but RoPE needs an even head_dim >= 2{most}")
    d = plain["draft"]
    outside = [i for i in d["aux_layers"] or () if i >= m["num_layers"]]
    if d["mode"] not in ("off", False) and outside:
        raise ConfigError(f"draft.aux_layers = {d['aux_layers']}: layer {outside[0]} is outside the model's "
                          f"{m['num_layers']} layers (model.num_layers); name layers 0..{m['num_layers'] - 1}")
    if m["num_experts"] and m["num_experts_per_tok"] > m["num_experts"]:
        raise ConfigError(f"model.num_experts_per_tok = {m['num_experts_per_tok']}: more than model.num_experts = "
                          f"{m['num_experts']}; route each token to at most num_experts experts")


def _check_settings(plain: dict, shape: Shape | None) -> None:
    """Sizes against the model and each other."""
    a, meg = plain["algo"], plain["megatron"]
    if shape is not None and a["max_new_tokens"] >= shape.positions:
        source = "model.max_position_embeddings" if shape.where == "model" else f"max_position_embeddings of {shape.where}"
        raise ConfigError(f"algo.max_new_tokens = {a['max_new_tokens']}: leaves no room for a prompt in the model's "
                          f"{shape.positions} positions ({source}); at most {shape.positions - 1}")
    if plain["runtime"]["learner"] != "megatron":
        return
    tp, dp, shares = meg["tp"], meg["dp"], meg["grad_shares"]
    if shape is not None:
        split = {"num_heads": shape.heads, "num_kv_heads": shape.kv, "intermediate_size": shape.inter}
        bad = {k: v for k, v in split.items() if v % tp}
        if bad:
            common = math.gcd(*split.values())
            source = "model." if shape.where == "model" else f"{shape.where}'s "
            sizes = ", ".join(f"{source}{k} = {v}" for k, v in split.items())
            raise ConfigError(f"megatron.tp = {tp}: each rank holds 1/tp of the attention heads and MLP features, so tp "
                              f"must divide {sizes}; choose one of {_divisors(common)}")
    if shares is not None and shares % dp:
        raise ConfigError(f"megatron.grad_shares = {shares}: not a multiple of megatron.dp = {dp} (every rank computes "
                          "the same number of shares); choose a multiple, or null for dp")


def _check_cpus(plain: dict, cpus: int) -> None:
    r, meg = plain["runtime"], plain["megatron"]
    where = f"the {cpus} CPU core(s) this process may use"
    local_workers = r["backend"] == "local" or not os.environ.get("RAY_ADDRESS")  # ray: a new local cluster
    if local_workers and r["rollout_workers"] > cpus:
        raise ConfigError(f"runtime.rollout_workers = {r['rollout_workers']}: more than {where} (each worker is a "
                          f"process generating with runtime.worker_threads threads); at most {cpus}")
    for key in ("worker_threads", "learner_threads"):
        if r[key] > cpus:
            raise ConfigError(f"runtime.{key} = {r[key]}: more threads than {where}; at most {cpus}")
    if r["learner"] == "megatron":
        _check_ranks(plain, meg, cpus, where)


# Learner ranks per core the Megatron learner accepts: up to this many share the cores (each with
# runtime.learner_threads = 1 thread, taking turns; slower, with the same bits); more is refused as a mistake.
MAX_RANKS_PER_CORE = 4


def _check_ranks(plain: dict, meg: dict, cpus: int, where: str) -> None:
    """The Megatron world against the cores: tp x pp x cp x dp ranks of runtime.learner_threads threads each.
    Fitting (ranks x threads <= cores) runs as asked; more ranks than cores run with 1 thread each (launch.py
    says so in one line); more threads than a core per rank then, or more than MAX_RANKS_PER_CORE ranks per
    core, is refused."""
    world = meg["tp"] * meg["pp"] * meg["cp"] * meg["dp"]
    threads = plain["runtime"]["learner_threads"]
    product = f"megatron.tp x pp x cp x dp = {meg['tp']} x {meg['pp']} x {meg['cp']} x {meg['dp']} = {world}"
    if world > MAX_RANKS_PER_CORE * cpus:
        key = max(("megatron.tp", "megatron.pp", "megatron.cp", "megatron.dp"), key=lambda k: _lookup(plain, k))
        raise ConfigError(f"{key} = {_lookup(plain, key)}: {product} learner processes on {where}, more than "
                          f"{MAX_RANKS_PER_CORE} per core; at most {MAX_RANKS_PER_CORE * cpus} in all")
    if world * threads > cpus and threads > 1:
        fit = max(1, cpus // world)
        raise ConfigError(f"runtime.learner_threads = {threads}: {product} learner processes of {threads} threads each "
                          f"need {world * threads} cores, more than {where}; at most {fit} with this layout")


def memory_need(plain: dict, shape: Shape) -> dict[str, float]:
    """A lower bound on the bytes a run holds at once, by part. Weights: the learner's (with gradients and Adam's
    two moments), max_lag + 1 kept versions, one copy per rollout worker (the draft's too); with LoRA
    (lora.rank > 0) gradients, Adam's moments and kept versions are the adapter's alone (`lora_params`).
    Rollout: each worker's KV cache, a slot per row of a batch, each of at least max_new_tokens + 1 positions.
    Activations: the autograd tensors of the learner's step (RL: 2+ tokens per row; warm-up: 3+), per token at
    least 4 x hidden + 3 x MLP features per layer and 2 x vocabulary logits, float32."""
    a, r, w = plain["algo"], plain["runtime"], plain["warmup"]
    h, layers = shape.hidden, shape.layers
    attn = h * shape.heads * shape.head_dim * 2 + h * shape.kv * shape.head_dim * 2
    if shape.experts:
        mlp, active = shape.experts * 3 * h * shape.moe_inter + h * shape.experts, max(shape.topk, 1) * shape.moe_inter
    else:
        mlp, active = 3 * h * shape.inter, shape.inter
    params = shape.vocab * h * (1 if shape.tied else 2) + layers * (attn + mlp)
    workers = r["rollout_workers"]
    adapter = lora_params(plain.get("lora") or {}, shape)
    if adapter:  # LoRA: the base frozen (no gradients, no Adam), held by the learner, once for the workers to read
        # (shared ring / object store) and by each worker; the float32 adapter trained and in every kept version
        weights = 4 * params * (2 + workers) + 4 * adapter * (4 + a["max_lag"] + 1 + workers)
    else:
        weights = 4 * params * (4 + a["max_lag"] + 1 + workers)
    d = plain["draft"]
    if d["mode"] not in ("off", False):  # dense layers of the target's width, trained (Adam) and shipped to every worker
        aux = len(d["aux_layers"]) if d["aux_layers"] else 3
        draft = d["num_layers"] * (attn + 3 * h * shape.inter) + (aux + 2) * h * h
        weights += 4 * draft * ((4 if d["mode"] == "cotrain" else 1) + a["max_lag"] + 1 + workers)
    rows = a["prompts_per_update"] * a["group_size"]
    kv_bytes = 2 if r["rollout_dtype"] == "bfloat16" else 4
    kv = workers * rows * (a["max_new_tokens"] + 1) * layers * 2 * shape.kv * shape.head_dim * kv_bytes
    per_token = 4 * (layers * (4 * h + 3 * active) + 2 * shape.vocab)
    rl = rows * 2 * per_token
    warm = w["batch_size"] * 3 * per_token if w["steps"] > 0 else 0
    return {"weights and optimizer state": weights, "rollout KV caches": kv, "RL step activations": rl,
            "warm-up step activations": warm}


# The linear layers lora.modules names (nemo_rz.models.lora's targets), by group: (in, out) features of each.
def _lora_dims(shape: Shape) -> dict[str, tuple[str, int, int]]:
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv * shape.head_dim
    return {"q_proj": ("attention", h, q), "k_proj": ("attention", h, kv), "v_proj": ("attention", h, kv),
            "o_proj": ("attention", q, h), "gate_proj": ("mlp", h, shape.inter), "up_proj": ("mlp", h, shape.inter),
            "down_proj": ("mlp", shape.inter, h), "experts.gate_up_proj": ("experts", h, 2 * shape.moe_inter),
            "experts.down_proj": ("experts", shape.moe_inter, h)}


def lora_params(lora: dict, shape: Shape) -> int:
    """The adapter's parameter count, rank x (in + out features) per adapted linear layer and, on an MoE model, per
    expert (one A for all with lora.expert_a = shared; 0 for lora.rank = 0); a lower bound: the layers of an MoE
    model's MLPs count only as much as a model without dense MLPs has (none)."""
    rank = lora.get("rank") or 0
    if rank <= 0:
        return 0
    dims = _lora_dims(shape)
    names = set()
    for n in (m.strip() for m in str(lora.get("modules", "all")).split(",")):
        names |= {k for k, (group, _, _) in dims.items() if n in ("all", group)} | ({n} & set(dims))
    per_layer = 0
    for n in names:
        group, n_in, n_out = dims[n]
        if group == "experts" and shape.experts:
            per_layer += rank * (shape.experts * n_out + n_in * (1 if lora.get("expert_a") == "shared" else shape.experts))
        elif group != "experts" and not (shape.experts and group == "mlp"):
            per_layer += rank * (n_in + n_out)
    return shape.layers * per_layer


def _total(need: dict[str, float]) -> float:
    return need["weights and optimizer state"] + max(need["rollout KV caches"] + need["RL step activations"],
                                                     need["warm-up step activations"])


# keys whose value the memory need grows with (a fresh model's dimensions only without hf_path)
_MEMORY_KEYS = ("algo.prompts_per_update", "warmup.batch_size", "algo.group_size", "algo.max_new_tokens",
                "runtime.rollout_workers", "algo.max_lag", "model.num_layers", "model.hidden_size",
                "model.intermediate_size", "model.moe_intermediate_size", "model.num_experts", "draft.num_layers")


def _largest_fitting(plain: dict, key: str, avail: float) -> int | None:
    """The largest value of `key` (others as given) whose memory need fits, or None when even its least does not."""
    import copy

    lo = SCHEMA[key].lo if SCHEMA[key].lo is not None else 0
    lo = max(int(lo), 1 if key not in ("algo.max_lag", "model.num_experts") else 0)
    value = _lookup(plain, key)
    if value is None or value <= lo:
        return None
    trial = copy.deepcopy(plain)

    def fits(v: int) -> bool:
        _assign(trial, key, v)
        shape = model_shape(trial)
        return shape is not None and _total(memory_need(trial, shape)) <= avail

    if not fits(lo):
        return None
    good, bad = lo, value  # fits(good), not fits(bad)
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


@functools.lru_cache(maxsize=1)
def _defaults() -> dict:
    from nemo_rz.config import DEFAULT  # config imports this module: only once both are loaded

    return OmegaConf.to_container(OmegaConf.load(DEFAULT), resolve=True)


def _check_memory(plain: dict, shape: Shape, avail: int) -> None:
    need = memory_need(plain, shape)
    total = _total(need)
    if total <= avail:
        return
    keys = [k for k in _MEMORY_KEYS if not (k.startswith("model.") and plain["model"]["hf_path"] is not None)
            and not (k == "warmup.batch_size" and plain["warmup"]["steps"] == 0)
            and not (k.startswith("model.") and "expert" in k and not plain["model"]["num_experts"])
            and not (k == "draft.num_layers" and plain["draft"]["mode"] in ("off", False))]
    defaults = _defaults()
    best = None  # the key raised most above its default that alone can bring the need down to what is available
    for key in keys:
        most = _largest_fitting(plain, key, avail)
        if most is not None:
            grown = _lookup(plain, key) / max(_lookup(defaults, key) or 1, 1)
            if best is None or grown > best[0]:
                best = (grown, key, most)
    parts = ", ".join(f"{name} {v / GIB:.1f}" for name, v in need.items() if v >= 0.05 * GIB)
    what = (f"needs at least {total / GIB:.1f} GiB of memory ({parts}), more than the {avail / GIB:.1f} GiB "
            "available on this machine")
    if best is None:
        raise ConfigError(f"the model and batch sizes: the run {what}; use a smaller model or smaller batches")
    _, key, most = best
    raise ConfigError(f"{key} = {_lookup(plain, key)}: the run {what}; lower it to at most {most} (the other settings "
                      "as they are)")


def check_sizes(plain: dict, machine: bool = True) -> None:
    """Every size against the model (heads, KV heads, MLP features, positions), the other settings, and (machine)
    this machine's cores and memory: one ConfigError naming the key, its value, the limit and why, before any
    process starts."""
    _check_model(plain)
    shape = model_shape(plain)
    _check_settings(plain, shape)
    if not machine:
        return
    _check_cpus(plain, usable_cpus())
    avail = available_memory()
    if shape is not None and avail is not None:
        _check_memory(plain, shape, avail)


def fixed_on_resume(key: str) -> bool:
    spec = SCHEMA.get(key)
    return spec is not None and spec.fixed
