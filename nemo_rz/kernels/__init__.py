"""Batch-invariant Triton kernels (packaged as ``nemo_rz.kernels``).

Every kernel computes each output row with a reduction order that does not depend on the batch size,
the batch composition or the row's position; each module's docstring states its rule. Importing this
package is cheap: Triton is imported only when a kernel is first used (``nemo_rz.kernels.linear``, ...).
On CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before first use).
"""

from __future__ import annotations

import importlib

from .window import check_window as check_window
from .window import window_start as window_start

_LAZY = {
    "linear": "matmul",
    "tile_config": "matmul",
    "rms_norm": "rmsnorm",
    "silu_and_mul": "activation",
    "token_logprobs": "logprobs",
    "log_softmax": "logprobs",
    "attention": "causal_attention",
    "KV_BLOCK": "causal_attention",
    "expert_linear": "moe",
}

__all__ = sorted([*_LAZY, "window_start", "check_window"])


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
