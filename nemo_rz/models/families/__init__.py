"""The model families nemo_rz loads, one module each (llama.py, qwen2.py, ...; the shared base in base.py).

Every module of this package but `base` holds one `FAMILY` (a base.Family); they are collected here into one
table, keyed by Hugging Face architecture name. Adding a family is adding a module (or, at run time, calling
`register`).

    TABLE                      {architecture: Family}
    by_architecture(arch)      the Family of an architecture name, or None
    by_model_type(mt)          the Family of a config.json model_type, or None
    by_gguf_arch(name)         the Family a GGUF general.architecture loads as, or None
    for_config(cfg)            the Family a DecoderConfig is saved as by default
    register(family)           add a family at run time (returns it)
"""
from __future__ import annotations

import importlib
import pkgutil

from nemo_rz.models.families.base import Family

TABLE: dict[str, Family] = {}
MODULES: list[str] = []  # the family modules found in this package


def register(family: Family) -> Family:
    if not isinstance(family, Family):
        raise TypeError(f"{family!r} is not a nemo_rz.models.families.base.Family")
    TABLE[family.architecture] = family
    return family


def unregister(architecture: str) -> None:
    TABLE.pop(architecture, None)


# the order messages list them in (the most used first); modules not named here follow, by name
_ORDER = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "qwen2_moe", "gpt_oss", "gemma3", "deepseek_v3")
for _info in sorted(pkgutil.iter_modules(__path__),
                    key=lambda m: (m.name not in _ORDER, _ORDER.index(m.name) if m.name in _ORDER else 0, m.name)):
    if _info.name == "base":
        continue
    MODULES.append(_info.name)
    register(importlib.import_module(f"{__name__}.{_info.name}").FAMILY)


def supported() -> str:
    return ", ".join(TABLE)


def by_architecture(arch: str) -> Family | None:
    return TABLE.get(arch)


def by_model_type(mt: str) -> Family | None:
    return next((f for f in TABLE.values() if mt in getattr(f, "model_types", (f.model_type,))), None)


def by_gguf_arch(name: str) -> Family | None:
    """The family a GGUF architecture loads as (the family of that model_type first: "llama" is Llama, though
    Mistral's GGUFs are written as "llama" too)."""
    found = [f for f in TABLE.values() if f.gguf_arch == name]
    return next((f for f in found if f.model_type == name), found[0] if found else None)


def gguf_architectures() -> tuple[str, ...]:
    return tuple(dict.fromkeys(f.gguf_arch for f in TABLE.values() if f.gguf_arch))


def for_config(cfg) -> Family:
    """The family a model with `cfg` is saved as by default: the lowest-ranked family that claims it."""
    claims = [f for f in TABLE.values() if f.natural(cfg)]
    if not claims:
        raise ValueError("no registered family can save this model")
    return min(claims, key=lambda f: f.rank)
