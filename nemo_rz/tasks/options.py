"""task.options, typed: each option's type comes from its task function's signature, its range from @limits.

check(name, fn, options) returns the options with their declared types (an int given for a float becomes a
float), after the task's own @checked_by check of them together (if any), or raises OptionError, one line naming
task.options.KEY, the value and what is valid. The config is
checked with it (nemo_rz.schema) before any work, and make_task checks again for direct callers. A plugin task
gets the same checks from its own annotations (int, float, bool, str, X | None, list[...]) and, optionally,
@limits(...) ranges; an option without an annotation is checked against its default's type when that is a
plain int, float, bool or str.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import math
import types
import typing

from nemo_rz.errors import OptionError

RENDERING = ("tokenizer", "chat_template", "system_prompt")  # set by make_task's own arguments, not task options


@dataclasses.dataclass(frozen=True)
class Range:
    lo: float | None = None  # inclusive, or exclusive when lo_open
    hi: float | None = None  # inclusive, or exclusive when hi_open
    lo_open: bool = False
    hi_open: bool = False
    null_means: str = ""  # what null does, for the message (an optional option)
    why: str = ""  # the reason for the range

    def accepts(self, value) -> bool:
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return True  # the type check speaks for those
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def text(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi}"
        if lo and hi and not self.lo_open and not self.hi_open:
            return f"in {self.lo}..{self.hi}"
        return " and ".join(t for t in (lo, hi) if t)


def limits(**ranges: Range):
    """Declare ranges of a task function's options: @limits(n_train=Range(1), heldout_fraction=Range(0, 1, True, True))."""
    def mark(fn):
        fn.option_ranges = dict(getattr(fn, "option_ranges", {}), **ranges)
        return fn
    return mark


def checked_by(check):
    """Declare a check of a task's options together (e.g. min_len <= max_len, the data files are readable), run
    with the config before any work: check(typed options given) raises ValueError, one line."""
    def mark(fn):
        fn.options_check = check
        return fn
    return mark


def _function(fn):
    while isinstance(fn, functools.partial):
        fn = fn.func
    return fn


@functools.lru_cache(maxsize=None)
def _declared(fn) -> dict[str, tuple]:
    """option -> (type or None (unchecked), has a default, default, Range or None)."""
    try:
        sig = inspect.signature(fn, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # an annotation that does not evaluate: names only
        sig = inspect.signature(fn)
    ranges = getattr(_function(fn), "option_ranges", {})
    out = {}
    for name, p in sig.parameters.items():
        if name in RENDERING or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        tp = p.annotation if p.annotation is not p.empty and not isinstance(p.annotation, str) else None
        if tp is None and type(p.default) in (int, float, bool, str):
            tp = type(p.default)
        out[name] = (tp, p.default is not p.empty, p.default, ranges.get(name))
    return out


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _accepts(tp, value) -> bool:
    if tp is None or tp is typing.Any:
        return True
    if _is_union(tp):
        return any(_accepts(t, value) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return type(value) is int
    if tp is float:
        return type(value) in (int, float) and math.isfinite(value)
    if tp is str:
        return isinstance(value, str) or type(value) is int  # name=2024 arrives as an int
    origin = typing.get_origin(tp)
    if origin in (list, tuple, collections.abc.Sequence):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and all(_accepts(args[0] if args else None, v) for v in value)
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True  # a type this check does not know: the task's own checks speak


def _normalised(tp, value):
    if value is None or tp is None:
        return value
    members = typing.get_args(tp) if _is_union(tp) else (tp,)
    if float in members and int not in members and type(value) is int:
        return float(value)
    if str in members and int not in members and type(value) is int:
        return str(value)
    return value


def _expected(tp, rng: Range | None) -> str:
    members = [t for t in (typing.get_args(tp) if _is_union(tp) else (tp,)) if t is not type(None)]
    nouns = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}
    text = " or ".join(nouns.get(t, getattr(t, "__name__", str(t))) for t in members) or "null"
    if rng is not None and rng.text():
        text += f" {rng.text()}"
    if _is_union(tp) and type(None) in typing.get_args(tp):
        text += f", or null{' ' + rng.null_means if rng is not None and rng.null_means else ''}"
    if rng is not None and rng.why:
        text += f" ({rng.why})"
    return text


def _shown(value) -> str:
    text = "null" if value is None else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check(name: str, fn, options: dict) -> dict:
    """The task options with their declared types; OptionError (one line) for an unknown, mistyped or
    out-of-range one."""
    declared = _declared(fn)
    if not isinstance(options, dict):
        raise OptionError(f"task.options = {_shown(options)}: expected a mapping of the task's options "
                          f"({', '.join(declared) or 'none'})")
    unknown = sorted(set(options) - set(declared))
    if unknown:
        raise OptionError(f"task {name!r}: unknown option(s) {', '.join(map(str, unknown))} in task.options: valid are "
                          f"{', '.join(declared) or 'none'}")
    out = {}
    for key, value in options.items():
        tp, _, _, rng = declared[key]
        if not _accepts(tp, value) or (rng is not None and not rng.accepts(value)):
            raise OptionError(f"task.options.{key} = {_shown(value)}: expected {_expected(tp, rng)} (task {name})")
        out[key] = _normalised(tp, value)
    together = getattr(_function(fn), "options_check", None)
    if together is not None:
        try:
            together(out)
        except ValueError as e:
            raise OptionError(str(e)) from None
    return out
