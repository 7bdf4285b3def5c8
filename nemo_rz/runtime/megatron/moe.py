"""Mixture-of-experts layers of the Megatron learner, with logprobs equal to the built-in Decoder's bit for bit
at every expert-parallel size (consistent kernels), and Megatron's stock MoE layer as the fast kernels.

Consistent (`spec(cfg, layer)`): Megatron's own MoELayer drives the layer (route, dispatch, experts, combine,
through its router / token-dispatcher / experts interfaces), with nemo-rz's modules behind each interface:
- `Router` (a TopKRouter): the Decoder's float32 router logits and the family's routing, models.moe.route
  (Qwen3-MoE softmax, top-k, optional renormalisation; gpt-oss top-k over the biased logits, softmax over k).
- `Experts` (Megatron's experts interface: rows grouped by local expert and their counts): the Decoder's own
  expert modules (models.moe.Qwen3MoeExperts / GptOssExperts, ops.expert_linear: a pair's bits depend only on
  its row and its expert's weights, never on how many rows the expert got), unweighted.
- `ExpertOrderDispatcher` (a MoETokenDispatcher): the routing weights are applied in the combine,
  ops.moe_combine, each token's k outputs added in increasing expert index, as the Decoder does.
Megatron's stock path cannot give these bits: its experts scale the activations by the routing probability
before the down projection (MLP per_token_scale: w * act, then fc2, where the Decoder computes w * fc2(act)),
its router uses torch.topk (ties unspecified) and torch.softmax, and its dispatchers add the experts' outputs
in scatter_add / reduce-scatter order (the all-gather dispatcher sums each rank's partial outputs over the
ranks). Its grouped experts need CUDA (grouped_gemm or Transformer Engine).

Expert parallelism (megatron.ep): as in Megatron, ep splits the experts over ep of the dp x cp ranks (the
data-parallel ranks that hold one tensor-parallel slice); ep adds no process: the config's megatron.dp, left at
its default, is the fewest ep needs (schema.data_parallel_size), and an explicit megatron.dp=1 with megatron.ep=2
is refused in one line (layout.Layout: raise megatron.dp). The dispatch is an all-gather over the expert-parallel
group (Megatron's all-gather dispatcher rule: every rank sees every token of the group, gloo all_gather, rank
order), each rank runs only its experts' (token, expert) pairs, and the pair outputs go back to the tokens'
ranks with one equal-split all-to-all (gloo all_to_all_single, Megatron's tensor_parallel.all_to_all); each
pair's output is then copied from the rank that owns its expert and combined there in expert-index order,
never in arrival order: a token's logprob does not depend on ep. Backward: the all-gather's input gradient is
the ranks' gradients summed in a fixed tree (parallel.tensor.all_gather_sum), so gradients are deterministic.
The expert weights are replicated on every rank (each rank computes only its experts; the others' gradients are
zero there and the data-parallel sum adds them exactly), so the weight names, the gradient sum, the norms and
the optimizer state stay those of the dense model: ep splits the experts' compute, not their memory (sharding
the weights and Adam moments over ep is not done yet).

Fast (`spec(cfg, layer, fast=True)`): Megatron's stock MoELayer, TopKRouter (its gating kept on the CPU), its
all-gather dispatcher and SequentialMLP experts (one local MLP per expert), Qwen3-MoE routing only (gpt-oss's
biased router and clamped SwiGLU are refused in one line), ep=1.

The routing record (models.moe.recorded_routing, Learner.decompose's routing_diff_tokens) covers consistent
layers: each forward logs its tokens' experts in the Decoder's (row, position) order and route_topk's slot order;
on leaving the record, a layer joins its forwards (the data-parallel shares this rank ran) and gathers them over
the data-parallel group in rank order (`finish_routing_log`): the whole batch's rows, as the learner compares them
with the rollout's routing (the padding rows the data-parallel cut adds at the end are cut there).

Not built: MoE with megatron.tp > 1 (refused in one line: experts split over ep, not their features), shared
experts, capacity / token dropping and auxiliary losses (nemo-rz's routing has none), expert weights sharded over
ep (see above).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel import all_to_all
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from torch import nn

from nemo_rz import ops
from nemo_rz.models import moe as decoder_moe
from nemo_rz.models.config import DecoderConfig
from nemo_rz.parallel.tensor import all_gather_sum, gather_parts


def config_fields(cfg: DecoderConfig) -> dict:
    """The TransformerConfig fields of the model's mixture of experts (none for a dense model). Megatron's stock
    router follows them (fast kernels); the consistent layer reads only the expert count and k."""
    if not cfg.num_experts:
        return {}
    return dict(num_moe_experts=cfg.num_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
                moe_router_topk=cfg.num_experts_per_tok, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                # qwen3 with renormalisation is softmax over the top-k logits, Megatron's default order
                moe_router_pre_softmax=not cfg.norm_topk_prob, moe_router_dtype="fp32",
                moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_permute_fusion=False)


def check(cfg: DecoderConfig, fast: bool) -> None:
    """What the Megatron learner's mixture of experts cannot build, refused in one line."""
    if fast and cfg.num_experts and cfg.moe_kind != "qwen3":
        raise ValueError(f"model moe_kind = {cfg.moe_kind!r}: Megatron's stock MoE layer (the fast kernels) has no "
                         "biased router or clamped SwiGLU experts; use kernels=consistent")


def spec(cfg: DecoderConfig, layer: int, fast: bool = False) -> type:
    """Layer `layer`'s MLP, a mixture of experts: nemo-rz's arithmetic behind Megatron's MoELayer interfaces
    (consistent), or Megatron's stock MoE layer (fast). A module class with its submodules bound (a ModuleSpec
    of a MoELayer subclass would make Megatron's TransformerLayer warn about an unknown MLP type)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():  # refused here, before Megatron wraps the error in its own words
        check_layout(cfg, parallel_state.get_expert_model_parallel_world_size(),
                     parallel_state.get_tensor_model_parallel_world_size(), fast)
    if fast:
        stock = get_moe_module_spec(use_te=False, num_experts=cfg.num_experts, moe_grouped_gemm=False).submodules
        return _bound(FastMoE, submodules=dataclasses.replace(stock, router=FastRouter, shared_experts=None),
                      model_config=cfg)
    experts = ModuleSpec(module=EXPERTS[cfg.moe_kind], params={"model_config": cfg})
    router = _bound(Router, model_config=cfg)
    return _bound(MoE, submodules=MoESubmodules(experts=experts, router=router), model_config=cfg)


def check_layout(cfg: DecoderConfig, ep: int, tp: int, fast: bool) -> None:
    """The expert- and tensor-parallel sizes a mixture of experts is built for, refused in one line where not."""
    if cfg.num_experts % ep:
        raise ValueError(f"megatron.ep = {ep} does not divide model num_experts = {cfg.num_experts}; "
                         "choose an ep that divides it")
    if tp > 1:
        raise ValueError(f"megatron.tp = {tp} with a mixture of experts: the Megatron learner splits experts over "
                         "megatron.ep, not their features; use megatron.tp=1")
    if fast and ep > 1:
        raise ValueError(f"megatron.ep = {ep}: the fast kernels' stock MoE layer runs its experts on one rank here; "
                         "use kernels=consistent or megatron.ep=1")


def _bound(cls: type, **params) -> type:
    """`cls` with some constructor keywords fixed."""
    def __init__(self, *args, **kwargs):
        cls.__init__(self, *args, **params, **kwargs)

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": cls.__qualname__})


# -- consistent ----------------------------------------------------------------------------------------
class Router(TopKRouter):
    """The Decoder's routing behind Megatron's router interface: (probs [N, E], routing_map [N, E]) for the
    dispatcher, and `chosen` = (weights [N, k] float32, experts [N, k]) in models.moe.route's order. The weight
    [E, H] (Megatron's name `router.weight`) and, for gpt-oss, the bias [E] (`router.bias`)."""

    def __init__(self, config, pg_collection=None, model_config: DecoderConfig | None = None):
        super().__init__(config=config, pg_collection=pg_collection)
        self.cfg, self.chosen = model_config, None
        if model_config.moe_kind == "gpt_oss" and self.bias is None:
            self.bias = nn.Parameter(torch.zeros(config.num_moe_experts, dtype=config.params_dtype))

    def forward(self, input: torch.Tensor, padding_mask=None):
        logits = decoder_moe.router_logits(input.reshape(-1, input.shape[-1]), self.weight, self.bias)
        weights, experts = decoder_moe.route(self.cfg, logits)
        self.chosen = weights, experts
        probs = torch.zeros_like(logits).scatter(1, experts, weights)
        return probs, torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)


class _Experts:
    """Megatron's experts interface over the Decoder's expert modules: forward(rows grouped by local expert,
    rows per local expert, their probabilities) -> (unweighted outputs, None). Every expert's weights are held
    (replicated over expert-parallel ranks, see the module doc); this rank runs its local experts only."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, model_config: DecoderConfig | None = None, **_):
        super().__init__(model_config)
        group = (pg_collection or get_default_pg_collection()).ep
        self.local = num_local_experts
        self.first = dist.get_rank(group) * num_local_experts if dist.get_world_size(group) > 1 else 0

    def forward(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, probs=None):
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.long).cpu()
        which = self.first + torch.repeat_interleave(torch.arange(self.local), counts).to(rows.device)
        return self.rows(rows, which), None

    def backward_dw(self):  # Megatron's delayed weight-gradient hook: nothing is delayed here
        pass


class Qwen3Experts(_Experts, decoder_moe.Qwen3MoeExperts):
    pass


class GptOssExperts(_Experts, decoder_moe.GptOssExperts):
    pass


EXPERTS = {"qwen3": Qwen3Experts, "gpt_oss": GptOssExperts}


class _GatherRows(torch.autograd.Function):
    """Every rank's rows [n, H] in rank order -> [world * n, H]; backward: the ranks' gradients summed in the fixed
    tree (parallel.tensor.all_gather_sum), this rank's rows kept."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        return gather_parts(x, group).reshape(-1, *x.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        total = all_gather_sum(grad.contiguous().unsqueeze(0), ctx.group)
        rank = dist.get_rank(ctx.group)
        return total[rank * ctx.n:(rank + 1) * ctx.n], None


class ExpertOrderDispatcher(MoETokenDispatcher):
    """All-gather dispatch over the expert-parallel group, this rank's (token, expert) pairs to its experts,
    the pair outputs back by one all-to-all, then ops.moe_combine in expert-index order (see the module doc)."""

    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection or get_default_pg_collection())
        self.first, self.local = local_expert_indices[0], num_local_experts
        self.chosen = None  # (weights, experts) of this forward's tokens, set by the MoE layer

    def dispatch_preprocess(self, tokens, routing_map, probs):
        self.shape = tokens.shape
        self.weights, self.experts = self.chosen
        return tokens.reshape(-1, tokens.shape[-1]), probs

    def token_dispatch(self, hidden, probs):
        self.n, k = self.experts.shape
        everyone = self.experts
        if self.ep_size > 1:
            sizes = gather_parts(torch.tensor([self.n]), self.ep_group).flatten().tolist()
            if len(set(sizes)) > 1:
                raise ValueError(f"megatron.ep = {self.ep_size}: the expert-parallel ranks' forwards have {sizes} tokens; "
                                 "they must be equal (the data-parallel shares of one batch are)")
            hidden = _GatherRows.apply(hidden, self.ep_group)
            everyone = gather_parts(self.experts, self.ep_group).reshape(-1, k)
        self.k, self.which = k, everyone.reshape(-1)  # the expert of every pair slot: token-major, k per token
        return hidden, probs

    def dispatch_postprocess(self, hidden, probs):
        which = self.which
        mine = ((which >= self.first) & (which < self.first + self.local)).nonzero().squeeze(1)
        self.slots = mine.index_select(0, torch.argsort(which.index_select(0, mine), stable=True))  # by expert
        local = which.index_select(0, self.slots) - self.first
        return (hidden.index_select(0, torch.div(self.slots, self.k, rounding_mode="floor")),
                torch.bincount(local, minlength=self.local), None)

    def combine_preprocess(self, y):
        return y.new_zeros(self.which.numel(), y.shape[-1]).index_copy(0, self.slots, y)

    def token_combine(self, full):
        if self.ep_size > 1:  # chunk r of every rank's pair outputs goes to rank r
            full = all_to_all(self.ep_group, full)
        return full

    def combine_postprocess(self, full):
        n, k = self.experts.shape
        if self.ep_size > 1:  # each pair's output from the rank that owns its expert (the others hold zeros)
            owner = torch.div(self.experts.reshape(-1), self.local, rounding_mode="floor")
            full = full.view(self.ep_size, n * k, -1)[owner, torch.arange(n * k, device=full.device)]
        return ops.moe_combine(full, self.weights, self.experts).view(self.shape)


class MoE(MoELayer, decoder_moe._Routed):
    """Megatron's MoELayer with the consistent router, experts and dispatcher (found by models.moe.recorded_routing,
    like the Decoder's MoE layers)."""

    def __init__(self, config, submodules: MoESubmodules, layer_number: int | None = None, pg_collection=None,
                 model_config: DecoderConfig | None = None):
        pg = pg_collection or get_default_pg_collection()
        check_layout(model_config, dist.get_world_size(pg.ep), dist.get_world_size(pg.tp), fast=False)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg)
        self.token_dispatcher = ExpertOrderDispatcher(self.num_local_experts, self.local_expert_indices, config, pg)

    def route(self, hidden_states: torch.Tensor, padding_mask=None):
        probs, routing_map = self.router(hidden_states)
        weights, experts = self.token_dispatcher.chosen = self.router.chosen
        if self.routing_log is not None:  # Megatron's [s, b] token order -> the Decoder's (row, position) order
            s, b = hidden_states.shape[:2]
            self.routing_log.append(experts.detach().view(s, b, -1).transpose(0, 1).reshape(b * s, -1).clone())
        return probs, routing_map

    def finish_routing_log(self, log: list[torch.Tensor]) -> list[torch.Tensor]:
        """The record of one data-parallel call as one batch (models.moe.recorded_routing): this rank's forwards
        (its shares, in order), then every data-parallel rank's in rank order: the shares' order, so the whole
        batch's rows (and the padding rows the data-parallel cut adds at the end)."""
        from megatron.core import parallel_state

        if not log:
            return log
        mine = torch.cat(log)
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            mine = gather_parts(mine, group).reshape(-1, mine.shape[-1])
        stages = getattr(self, "stages", None)
        return [mine] if stages is None else stages.finish(self, log, mine)


class StageRouting:
    """The routing record over pipeline stages (set on a stage's MoE layers by model.MegatronPolicy at pp > 1).

    A stage holds only its layers, yet the learner compares the whole model's routing, every layer's experts in
    layer order (Learner.decompose concatenates the record's layers in order). So the stage's MoE layers, as
    recorded_routing finishes them (in order), hand their whole-batch records here; the last one gathers every
    stage's over the pipeline group and the whole model's layers are dealt back, in layer order, in contiguous
    blocks over this stage's layers' logs (each log then holds one [N, k x its block's layers] tensor; the
    earlier logs, already finished, are refilled in place): every rank's record reads the whole model."""

    def __init__(self, layers: dict[int, nn.Module], group):
        self.index = {id(m): i for i, m in layers.items()}  # layer module -> its index in the whole model
        self.count, self.group, self.done = len(layers), group, []

    def finish(self, layer: nn.Module, log: list, record: torch.Tensor) -> list[torch.Tensor]:
        self.done.append((self.index[id(layer)], log, record))
        if len(self.done) < self.count:
            return [record]  # refilled when the stage's last layer finishes
        done, self.done = self.done, []
        stages = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(stages, [(i, r.cpu()) for i, _, r in done], group=self.group)
        records = [r.to(record.device) for _, r in sorted((x for stage in stages for x in stage), key=lambda x: x[0])]
        per, extra = divmod(len(records), len(done))
        start = 0
        for j, (_, own, _) in enumerate(done):
            n = per + (j < extra)
            own[:] = [torch.cat(records[start:start + n], -1)]
            start += n
        return list(log)


# -- fast: Megatron's stock layer ------------------------------------------------------------------------
class FastRouter(TopKRouter):
    """Megatron's TopKRouter, its gating on the weights' device (the stock one moves them to CUDA)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        # moe_utils.router_gating_linear's product without Transformer Engine (its TE check fails without TE)
        x = input.reshape(-1, input.shape[-1]).float()
        out = torch.mm(x, self.weight.float().t()) if self.bias is None else torch.addmm(self.bias.float(), x, self.weight.float().t())
        return out.view(*input.shape[:-1], -1)


class FastMoE(MoELayer):
    """Megatron's stock MoELayer; expert parallelism only in the consistent layer."""

    def __init__(self, config, submodules: MoESubmodules, layer_number: int | None = None, pg_collection=None,
                 model_config: DecoderConfig | None = None):
        pg = pg_collection or get_default_pg_collection()
        check_layout(model_config, dist.get_world_size(pg.ep), dist.get_world_size(pg.tp), fast=True)
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, pg_collection=pg)
