"""Linear layers and embedding lookup."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_rz.ops.dispatch import compute_dtype, kernel_op, on_gpu_kernels
from nemo_rz.ops.gemm import linear_rows
from nemo_rz.ops.kernel_set import consistent
from nemo_rz.ops.weight_cache import derived


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias over the last dim of x; weight is [N, K].

    Consistent: each output element's reduction order depends only on (K, N, dtype), never on how many
    rows x has or where a row sits (gemm.py; fp32 accumulation; output in x's dtype).
    """
    if not consistent():
        return F.linear(x, weight, bias)
    k, n = x.shape[-1], weight.shape[0]
    if on_gpu_kernels(x):
        from nemo_rz import kernels

        rows = x.reshape(-1, k)
        if weight.dtype != x.dtype:  # e.g. float32 activations on a bf16 router: both in float32, as on CPU
            rows, weight = rows.to(compute_dtype(x)), weight.to(compute_dtype(x))
        if weight.stride(-1) != 1:  # a Linear weight's [K, N] storage (models/layers.py): the kernel reads [N, K] rows
            # rollouts keep the copy per weight version; the learner's is differentiable (to reach the parameter)
            weight = weight.contiguous() if weight.requires_grad and torch.is_grad_enabled() else \
                derived(weight, "gpu.rows", lambda: weight.detach().contiguous())
        out = kernel_op(kernels.linear, _linear_backward, rows, weight, bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    dt = compute_dtype(x)
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    if rows.dtype != dt:
        rows = rows.to(dt)
    out = linear_rows(rows, weight)  # computed in dt whatever the weight's storage dtype
    if bias is not None:
        out = out + (bias if bias.dtype == dt else bias.to(dt))
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def _linear_backward(grad, needs, x, weight, bias):
    """The library's products, as gemm._Matmul's, in the kernel's storage dtype (GPU GEMMs accumulate half
    types in float32): nothing to recompute."""
    return (grad.mm(weight) if needs[0] else None,
            grad.t().mm(x) if needs[1] else None,
            grad.sum(0, dtype=torch.float32).to(bias.dtype) if needs[2] else None)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Row lookup: exact in every mode."""
    return F.embedding(ids, weight)
