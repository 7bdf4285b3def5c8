"""Input checks and launch helpers shared by the kernels (no Triton import here)."""

from __future__ import annotations

import os
from typing import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels with its numpy interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_device(name: str, tensors: Iterable[torch.Tensor]) -> torch.device:
    """All tensors on one device; CUDA unless the Triton interpreter is on."""
    tensors = list(tensors)
    dev = tensors[0].device
    for t in tensors[1:]:
        if t.device != dev:
            raise ValueError(f"{name}: all tensors must be on one device, got {dev} and {t.device}")
    if dev.type != "cuda" and not interpreting():
        raise ValueError(
            f"{name}: Triton kernels need CUDA tensors (got {dev}); on CPU set TRITON_INTERPRET=1 "
            "or use the torch path of nemo_rz.ops"
        )
    return dev


def check_tensor(name: str, arg: str, t, ndim: int, dtypes=FLOAT_DTYPES, rows_strided: bool = False) -> None:
    """Type, rank, dtype and layout check. ``rows_strided``: only the last dim must be contiguous."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: {arg} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: {arg} dtype must be one of {allowed}, got {str(t.dtype).replace('torch.', '')}")
    if rows_strided:
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: {arg} must have a contiguous last dimension (call .contiguous())")
    elif not t.is_contiguous():
        raise ValueError(f"{name}: {arg} must be contiguous (call .contiguous())")


def num_sms(device: torch.device) -> int:
    """Programs of a persistent kernel: the SM count on CUDA, a small constant in the interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4
