"""Optional dependencies: check that the modules a feature needs are installed, with one line saying how to get them."""
from __future__ import annotations

import importlib.util

# Module sets per feature; the pip extras that provide them are in setup.py (hf, math).
HF_TOKENIZER = ("transformers", "tokenizers", "jinja2")
GGUF = ("transformers", "tokenizers", "gguf", "accelerate")
MATH_VERIFY = ("math_verify",)


def require(modules: tuple[str, ...], purpose: str, extra: str) -> None:
    """Raise ValueError (one line) naming the missing modules, what needed them and the extra that installs them."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"{purpose} needs the Python package(s) {', '.join(m.replace('_', '-') for m in missing)}: "
                         f'pip install "nemo-rz[{extra}]" (or pip install -e ".[{extra}]" in a checkout)')
