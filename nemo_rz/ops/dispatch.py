"""Where a consistent op runs: Triton kernels on CUDA tensors, fixed row tiles in torch elsewhere."""
from __future__ import annotations

import torch

from nemo_rz.ops.mode import consistent


def on_gpu_kernels(x: torch.Tensor) -> bool:
    return consistent() and x.is_cuda


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Consistent ops accumulate in float32 whatever the storage dtype (bf16 weights included)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
