"""Where a consistent op runs: Triton kernels on CUDA tensors, fixed row tiles in torch elsewhere.

The kernels have no autograd of their own. `kernel_op` makes a kernel call differentiable the way the CPU path
is (gemm._Matmul, logprobs._LogSoftmax): the value is the kernel's, bit for bit, and the backward is the
library's, computed from the saved inputs. Only the forward's logprobs must equal the rollout's; gradients must
be deterministic run to run, not batch-invariant.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from nemo_rz.ops.kernel_set import consistent

# backward(grad, needs, *inputs) -> one gradient (or None) per input; needs[i]: does input i want one.
Backward = Callable[..., Sequence[torch.Tensor | None]]


def on_gpu_kernels(x: torch.Tensor) -> bool:
    return consistent() and x.is_cuda


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Consistent ops accumulate in float32 whatever the storage dtype (bf16 weights included)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def kernel_op(kernel: Callable[..., torch.Tensor], backward: Backward, *inputs: torch.Tensor | None) -> torch.Tensor:
    """kernel(*inputs) with `backward` as its gradient. inputs: the tensors gradients may flow to (None allowed);
    kernel and backward close over everything else (indices, constants)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _KernelOp.apply(kernel, backward, *inputs)
    return kernel(*inputs)


def by_recomputing(reference: Callable[..., torch.Tensor]) -> Backward:
    """The backward of `reference` (torch ops, the kernel's math), recomputed from the saved inputs: the kernel's
    forward keeps no intermediates, as an activation-checkpointed layer."""

    def backward(grad, needs, *inputs):
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(need) for t, need in zip(inputs, needs)]
            out = reference(*leaves)
        grads = iter(torch.autograd.grad(out, [t for t, need in zip(leaves, needs) if need], grad.to(out.dtype),
                                         allow_unused=True))
        return [next(grads) if need else None for need in needs]

    return backward


class _KernelOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, backward, *inputs):
        ctx.backward_fn = backward
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[2:]
        return None, None, *ctx.backward_fn(grad, needs, *ctx.saved_tensors)
