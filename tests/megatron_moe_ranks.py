"""One rank of the multi-process mixture-of-experts checks in test_megatron_moe.py (launch.start, 2 ranks, dp=2):
EP=2 logprobs (each rank its own half of the batch), the routing record, then EP=2 learner updates, twice
from the same start, with decompose's routing comparison; rank 0 saves what it got to argv[1]."""
import dataclasses
import sys

import torch
from megatron_ranks import rl_batch

from nemo_rz import ops
from nemo_rz.generation.packing import Packed
from nemo_rz.models.moe import recorded_routing
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.learner import MegatronLearner
from nemo_rz.runtime.megatron.model import MegatronPolicy
from nemo_rz.runtime.weights import WeightsBundle

VOCAB = 47


def moe_model(seed: int = 0, **overrides):
    """A tiny Qwen3-MoE-shaped Decoder (4 experts, k=2) with weights large enough to route unevenly."""
    from conftest import tiny_model

    model = tiny_model(seed, **{**dict(vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48),
                                **overrides})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 3 or name.endswith("bias"):
                p.normal_(0, 0.3)
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (6, 13), generator=g), torch.tensor([13, 9, 5, 13, 2, 11])


def learner(mirror, layout: Layout) -> MegatronLearner:
    return MegatronLearner(mirror, layout, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})


def routed_batch(model) -> tuple[Packed, torch.Tensor]:
    """rl_batch with the rollout's routing: the Decoder's experts of every layer, [B, T-1, layers * k]."""
    packed, advantages = rl_batch()
    with torch.no_grad(), recorded_routing(model) as routing:
        model.token_logprobs(packed.input_ids)
    b, length = packed.input_ids.shape
    experts = torch.cat([log[0].view(b, length, -1) for log in routing.values()], -1)[:, :-1]
    return dataclasses.replace(packed, rollout_routing=experts.to(torch.int16)), advantages


def updates(model, layout: Layout, steps: int = 2) -> dict:
    """`steps` RL updates at `layout` (rank 0 drives, the other rank follows): gradients and weights after, and
    decompose's routing_diff_tokens at the start's weights (the rollout's routing, then one expert changed)."""
    if torch.distributed.get_rank():
        MegatronLearner.follow()
        return {}
    lrn = learner(model, layout)
    packed, _ = routed_batch(model)
    start = WeightsBundle(0, model.state_dict())
    flipped = packed.rollout_routing.clone()
    flipped[0, 5, 0] = (flipped[0, 5, 0] + 1) % model.config.num_experts  # row 0 position 5: under the loss mask
    out = dict(routing_diff=[lrn.decompose(p, start)["routing_diff_tokens"]
                             for p in (packed, dataclasses.replace(packed, rollout_routing=flipped))])
    for _ in range(steps):
        lrn.rl_step(*rl_batch())
    out.update(grads=[p.grad.clone() for p in lrn.model.parameters()], weights=lrn.state_dict_copy())
    lrn.stop()
    return out


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank = None
    got = {}
    for kind, model in (("qwen3", moe_model(0)), ("gpt_oss", moe_model(0, moe_kind="gpt_oss", num_experts_per_tok=3,
                                                                       qk_norm=False, moe_layers=[1]))):
        distributed.init(Layout(dp=2, ep=2))
        rank = torch.distributed.get_rank()
        ids, lengths = batch()
        mine = slice(3 * rank, 3 * rank + 3)  # each rank its own rows: the experts see the other rank's tokens
        with ops.use_kernels("consistent"):
            policy = MegatronPolicy(model.config)
            policy.load_state_dict(model.state_dict())
            with torch.no_grad(), recorded_routing(policy) as routing:
                lp = policy.token_logprobs(ids[mine], lengths[mine])
            parts = [torch.empty_like(lp) for _ in range(2)]
            torch.distributed.all_gather(parts, lp)
            got[f"{kind}_ep2"] = torch.cat(parts)
            got[f"{kind}_ep2_routing"] = {name: [e.clone() for e in log] for name, log in routing.items()}
            got[f"{kind}_ep2_weights"] = policy.state_dict()
            got[f"{kind}_local_experts"] = [getattr(layer.mlp, "num_local_experts", None) for layer in policy.gpt.decoder.layers]
    with ops.use_kernels("consistent"):
        for run in ("a", "b"):  # the same updates twice, from the same start: the same bits
            got[f"updates_{run}"] = updates(moe_model(0), Layout(dp=2, ep=2))
    if rank == 0:
        torch.save(got, out)


if __name__ == "__main__":
    main(sys.argv[1])
