"""The kernel contract: every number that reaches a logprob is computed here.

Each op has a `consistent` form (fixed reduction order, independent of batch size, composition, position,
padding, decode vs prefill) and a `fast` form (library defaults: the "standard kernels" that REINFORCE Zero is
compared against, and every equality test's negative control). Select with `set_kernels`, the `use_kernels` context
manager, or the environment variable NEMO_RZ_KERNELS; `consistent` is the default.
"""
from nemo_rz.ops.activation import clamped_swiglu, gelu_tanh_and_mul, silu_and_mul
from nemo_rz.ops.aten import batch_invariant
from nemo_rz.ops.attention import ATTN_TILE_ROWS, KV_BLOCK, AttentionPlan, attention
from nemo_rz.ops.kernel_set import KERNELS, get_kernels, set_kernels, use_kernels
from nemo_rz.ops.linear import embedding, linear
from nemo_rz.ops.logprobs import lm_head_logprobs, log_softmax, probabilities, token_logprobs
from nemo_rz.ops.moe import expert_linear, moe_combine, route_grouped_topk, route_topk, sigmoid, softmax
from nemo_rz.ops.norm import rms_norm
from nemo_rz.ops.rope import rope, rope_cos_sin
from nemo_rz.ops.tiles import TILE_ROWS
from nemo_rz.ops.weight_cache import forget_weight_copies

__all__ = [
    "ATTN_TILE_ROWS", "AttentionPlan", "KV_BLOCK", "TILE_ROWS", "attention", "batch_invariant", "clamped_swiglu", "embedding",
    "expert_linear", "forget_weight_copies", "gelu_tanh_and_mul", "get_kernels", "KERNELS", "linear", "lm_head_logprobs",
    "log_softmax", "moe_combine", "probabilities", "rms_norm", "rope", "rope_cos_sin", "route_grouped_topk", "route_topk",
    "set_kernels", "sigmoid", "silu_and_mul", "softmax", "token_logprobs", "use_kernels",
]
