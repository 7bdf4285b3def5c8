"""Sliding-window bounds, defined once for every attention path.

Convention: a query at position ``p`` with window ``w`` sees the keys ``window_start(p, w) .. p``
inclusive, i.e. at most ``w`` keys counting itself (the Mistral / HF ``sliding_window`` convention).
``window=None`` means full causal attention (first visible key is 0).

Pure Python/torch on purpose: no Triton import. The Triton attention wrapper evaluates this on its
``positions`` tensor and passes the result to the kernel, and the torch path of ``nemo_rz.ops`` calls the
same function, so both read the bound from this single definition.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

PositionLike = Union[int, torch.Tensor]


def check_window(window: Optional[int]) -> Optional[int]:
    """Return ``window`` if it is None or an int >= 1; raise a one-line ValueError otherwise."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")
    return window


def window_start(position: PositionLike, window: Optional[int]) -> PositionLike:
    """First key index visible to a query at ``position`` (int or integer tensor, same type back).

    ``max(0, position - window + 1)``, or 0 when ``window`` is None.
    """
    check_window(window)
    if isinstance(position, torch.Tensor):
        if window is None:
            return torch.zeros_like(position)
        return torch.clamp_min(position - (window - 1), 0)
    if window is None:
        return 0
    return max(0, int(position) - (window - 1))
