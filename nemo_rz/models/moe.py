"""Mixture-of-experts MLPs, the three routing families: Qwen3-MoE, gpt-oss and DeepSeek-V3.

Both run the same consistent pipeline: float32 router logits (ops.linear on float32 activations, whatever the
model dtype), deterministic top-k (ops.route_topk: ties go to the lower expert index), the family's weight
normalisation, every (token, chosen expert) pair through its expert with ops.expert_linear (fixed row tiles:
a pair's bits depend neither on how many tokens the expert got nor on the other tokens; no capacity, nothing
dropped), and ops.moe_combine (each token's k outputs added in increasing expert order). So a token's routing
and output are the same bits in any batch: the learner recomputes the rollout's routing exactly, no replay.

Expert weights are stacked 3-D parameters under transformers' (v5) names: Qwen3-MoE `experts.gate_up_proj`
[E, 2I, H] (gate rows, then up rows) and `experts.down_proj` [E, H, I]; gpt-oss `experts.gate_up_proj`
[E, H, 2I] (gate and up interleaved), `experts.down_proj` [E, I, H] and their biases. DeepSeek-V3's experts
are Qwen3-MoE's layout, beside `gate.weight`, `gate.e_score_correction_bias` and `shared_experts.*`.

DeepSeek routing (`route`, moe_kind "deepseek"): scores = sigmoid(float32 logits); the selection adds
e_score_correction_bias (never the weights) and is group-limited (ops.route_grouped_topk: ties to the lower
group, then the lower expert index); the weights are the chosen unbiased scores, renormalised (when
norm_topk_prob) by their sum taken in increasing expert index, then times routed_scaling_factor; the shared
experts' output is added once, after the routed combine.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.families import gpt_oss, qwen3_moe
from nemo_rz.models.layers import MLP, Linear
from nemo_rz.ops.weight_cache import derived


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """[E, out, in] -> contiguous [E, in, out] for ops.expert_linear. Without autograd the copy is kept on the
    weight until it changes (ops.weight_cache, as ops.linear keeps its copies; ops.forget_weight_copies drops
    it)."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return weight.transpose(1, 2).contiguous()
    return derived(weight, "experts.t", lambda: weight.detach().transpose(1, 2).contiguous())


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 router logits whatever the model dtype (a bf16 router's weights are exact in float32)."""
    return ops.linear(x.float(), weight.float(), None if bias is None else bias.float())


def route(cfg: DecoderConfig, logits: torch.Tensor,
          selection_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The family's routing of float32 router logits [N, E] -> (weights [N, k] float32, experts [N, k]).
    qwen3: softmax over all experts, top-k, renormalised when norm_topk_prob; gpt_oss: top-k over the logits,
    softmax over the k chosen; deepseek: see the module docstring (selection_bias: e_score_correction_bias).
    (The Megatron learner's router runs this too: runtime/megatron/moe.py.)"""
    if cfg.moe_kind == "deepseek":
        return _deepseek_route(cfg, logits, selection_bias)
    if cfg.moe_kind == gpt_oss.FAMILY.moe_kind:
        top, experts = ops.route_topk(logits, cfg.num_experts_per_tok)
        return ops.softmax(top), experts
    weights, experts = ops.route_topk(ops.softmax(logits), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / _row_sum(weights)
    return weights, experts


def _deepseek_route(cfg: DecoderConfig, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    scores = ops.sigmoid(logits)
    choice = scores if bias is None else scores + bias.float()
    experts = ops.route_grouped_topk(choice, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group)
    weights = scores.gather(1, experts)
    if cfg.norm_topk_prob:
        by_index = torch.sort(experts, dim=1, stable=True)[1]  # the sum in increasing expert index
        weights = weights / (_row_sum(weights.gather(1, by_index)) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def _pairs(x: torch.Tensor, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of x repeated once per chosen expert [N * k, H], the expert of each row [N * k])."""
    n, k = experts.shape
    return x.repeat_interleave(k, dim=0), experts.reshape(n * k)


def adapted(experts: nn.Module, name: str, rows: torch.Tensor, which: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y [M, out], the expert product `name` (gate_up_proj, down_proj) of rows [M, in] (row m through expert
    which[m]), plus what the experts module's `product_hook` adds, if it has one (models/lora.py's expert adapters:
    a seam, so the experts know nothing of LoRA)."""
    hook = getattr(experts, "product_hook", None)
    return y if hook is None else hook(experts, name, rows, which, y)


def expert_product(experts: nn.Module, name: str, rows: torch.Tensor, which: torch.Tensor,
                   weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """ops.expert_linear(rows, which, weight_t, bias) in rows' dtype, `adapted`."""
    return adapted(experts, name, rows, which, ops.expert_linear(rows, which, weight_t, bias))


def _row_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over the k columns, left to right: a fixed order for every row."""
    total = values[:, 0]
    for j in range(1, values.shape[1]):
        total = total + values[:, j]
    return total.unsqueeze(1)


class _Routed(nn.Module):
    """A mixture-of-experts MLP: route (the family's rule), then the experts."""

    routing_log: list | None = None  # set by `recorded_routing`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.routing_log is not None:
            self.routing_log.append(experts.detach().clone())
        return self.experts(x, experts, weights)


@contextlib.contextmanager
def recorded_routing(model: nn.Module):
    """Yield {layer name: [experts [N, k] of each forward]} for every MoE layer of `model`, filled while inside.
    A layer with a `finish_routing_log(log)` method replaces its log with what that returns on leaving (the
    Megatron learner's layers: every data-parallel share's forwards, as one batch)."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, _Routed)}
    logs = {name: [] for name in layers}
    for name, m in layers.items():
        m.routing_log = logs[name]
    try:
        yield logs
        for name, m in layers.items():
            if hasattr(m, "finish_routing_log"):
                logs[name][:] = m.finish_routing_log(logs[name])
    finally:
        for m in layers.values():
            m.routing_log = None


class Qwen3MoeExperts(nn.Module):
    out_in = True  # weights stored [E, out, in]

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=cfg.torch_dtype))
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=cfg.torch_dtype))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return qwen3_moe.activation(gate_up)

    def rows(self, rows: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Row m of rows [M, H] through expert which[m] (unweighted) -> [M, H]."""
        gate_up = expert_product(self, "gate_up_proj", rows, which, transposed(self.gate_up_proj), None)
        return expert_product(self, "down_proj", self.activation(gate_up), which, transposed(self.down_proj), None)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_combine(self.rows(*_pairs(x, experts)), weights, experts)


class Qwen3Moe(_Routed):
    """Router `gate` (no bias): softmax over all experts, top-k, renormalised when norm_topk_prob. With
    shared_expert_intermediate_size (Qwen2-MoE) a shared expert too, scaled by sigmoid(shared_expert_gate(x))
    (ops.sigmoid, float32, then the model dtype) and added once after the routed combine."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, cfg.torch_dtype)
        self.experts = Qwen3MoeExperts(cfg)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, cfg.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        if not self.cfg.shared_expert_intermediate_size:
            return routed
        return routed + ops.sigmoid(self.shared_expert_gate(x)).to(x.dtype) * self.shared_expert(x)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [N, k] float32, experts [N, k])."""
        return route(self.cfg, router_logits(x, self.gate.weight, self.gate.bias))


class GptOssExperts(nn.Module):
    out_in = False  # weights stored [E, in, out]

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        e, h, i, dt = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.torch_dtype
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i, dtype=dt))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=dt))
        self.down_proj = nn.Parameter(torch.empty(e, i, h, dtype=dt))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, dtype=dt))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        return gpt_oss.activation(gate_up, self.limit)

    def rows(self, rows: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
        """Row m of rows [M, H] through expert which[m] (unweighted) -> [M, H]."""
        gate_up = expert_product(self, "gate_up_proj", rows, which, self.gate_up_proj, self.gate_up_proj_bias)
        return expert_product(self, "down_proj", self.activation(gate_up), which, self.down_proj, self.down_proj_bias)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return ops.moe_combine(self.rows(*_pairs(x, experts)), weights, experts)


class GptOssMoe(_Routed):
    """Router with bias: top-k over the logits, softmax over the k chosen."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.router = Linear(cfg.hidden_size, cfg.num_experts, True, cfg.torch_dtype)
        self.experts = GptOssExperts(cfg)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.cfg, router_logits(x, self.router.weight, self.router.bias))


class DeepseekRouter(nn.Module):
    """DeepSeek's router: `weight` [E, H] and the float32 `e_score_correction_bias` [E] (selection only; set by
    the checkpoint's load balancing, not by gradients: a buffer, as in transformers, that travels with the
    weights in the state dict)."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.weight = nn.Parameter(nn.init.normal_(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=cfg.torch_dtype), std=0.02))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))


class DeepseekMoe(_Routed):
    """Routed experts (Qwen3-MoE's layout) under DeepSeek routing, plus the always-on shared experts."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = DeepseekRouter(cfg)
        self.experts = Qwen3MoeExperts(cfg)
        if cfg.n_shared_experts:
            self.shared_experts = MLP(cfg, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.cfg, router_logits(x, self.gate.weight, None), self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)
        return routed + self.shared_experts(x) if self.cfg.n_shared_experts else routed


# the families' moe_kind
KINDS = {qwen3_moe.FAMILY.moe_kind: Qwen3Moe, gpt_oss.FAMILY.moe_kind: GptOssMoe, "deepseek": DeepseekMoe}
