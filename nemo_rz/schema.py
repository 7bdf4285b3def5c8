"""Every configuration key's type, valid range, and whether a resumed run may change it: declared once, here.

validate(cfg) checks a merged config before any work and returns it resolved (interpolations replaced, ints
given for floats made floats); the first bad key raises ConfigError naming the key, its value and what is
valid, in a fraction of a second: nothing here imports torch. Losses, corrections and tasks are the names
registered through nemo_rz.plugins (package metadata only, read after the plain checks, so a plugin's name
validates); the small fixed sets that code also checks (kernel modes, dtypes) are written out here, and
tests/test_config.py checks them against the code's own tuples.

A new key: add it to conf/default.yaml (with a comment) and a line to SCHEMA; tests/test_config.py checks
that the two agree and that the defaults pass.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable

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


KERNEL_MODES = ("consistent", "fast")  # nemo_rz.ops.MODES
PRECISION_RECIPES = ("none", "bf16", "fp8_current", "fp8_block", "mxfp8", "mxfp4", "nvfp4")  # nemo_rz.quant.linear.PRECISIONS

SCHEMA: dict[str, Key] = {
    "seed": Int(0, MAX_SEED, fixed=True),
    "run_dir": Str(optional=True, null_means="for runs/<task>-<timestamp>"),
    "resume": Str(optional=True, null_means="for a new run"),
    "kernels": Choice(KERNEL_MODES),
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
    "runtime.rollout_kernels": Choice(KERNEL_MODES, optional=True, null_means="for the same as kernels"),
    "runtime.rollout_dtype": Choice(("float32", "bfloat16")),  # nemo_rz.models.config.DTYPES
    "runtime.crash_worker_at_batch": Int(-1, why="-1 = never"),
    "runtime.learner": Choice(("builtin", "megatron"), fixed=True, why="megatron needs the megatron extra"),
    "megatron.tp": Int(1, fixed=True, why="tensor-parallel ranks"),
    "megatron.pp": Int(1, 1, fixed=True, why="pipeline parallelism is not supported yet"),
    "megatron.dp": Int(1, fixed=True, why="data-parallel ranks"),
    "megatron.grad_shares": Int(1, optional=True, null_means="for megatron.dp", fixed=True),
    "generation.backend": Choice(("builtin", "vllm")),
    "precision.recipe": Choice(PRECISION_RECIPES, why="fp8_delayed is not offered: its amax history of earlier "
                               "batches would make a token's bits depend on them"),
    "precision.modules": Choice(("all", "attention", "mlp", "experts")),
    "precision.activation_scaling": Choice(("row", "tensor"), why="tensor = TE's per-tensor amax, which breaks batch invariance"),
    "eval.every": Int(0, why="0 = only at the end"),
    "eval.n": Int(1),
    "draft.mode": Choice(("off", "cotrain", "frozen", False), fixed=True,  # nemo_rz.algorithms.draft.MODES
                         why="YAML reads a bare off as false, which means off too"),
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
    "checkpoint.every": Int(0, why="0 = never"),
    "checkpoint.keep": Int(1),
}


def _lookup(plain: dict, key: str):
    node = plain
    for part in key.split("."):
        node = node[part]
    return node


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


def validate(cfg: DictConfig) -> DictConfig:
    """Check every declared key (plain checks first, then registry-backed choices); return the config resolved."""
    plain = resolved(cfg)
    order = sorted(SCHEMA.items(), key=lambda kv: callable(kv[1].choices))
    for key, spec in order:
        try:
            value = _lookup(plain, key)
        except (KeyError, TypeError):
            raise ConfigError(f"config key {key} is missing; add it (see conf/default.yaml)") from None
        if not spec.accepts(value):
            shown = "null" if value is None else repr(value)
            raise ConfigError(f"{key} = {shown}: expected {spec.expected()}{spec.hint(value)}")
        _assign(plain, key, spec.normalised(value))
    return OmegaConf.create(plain)


def fixed_on_resume(key: str) -> bool:
    spec = SCHEMA.get(key)
    return spec is not None and spec.fixed
