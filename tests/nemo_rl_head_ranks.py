"""One rank of test_nemo_rl_bridge.py's tensor-parallel check of the NeMo RL head (started by launch.start, 2
ranks): a GPTModel at TP=2 whose output layer is first Megatron's ColumnParallelLinear, then the one
bridge.consistent_output_layer puts in its place; its vocabulary shards through nemo_rl_policy.VocabParallelLogprobs,
through NeMo RL's distributed log-softmax (re-implemented from nemo_rl/distributed/model_utils.py,
DistributedLogprob.forward) and gathered in the wrong rank order. Rank 0 saves every rank's results to argv[1]."""
import sys

import torch
import torch.distributed as dist
from conftest import tiny_model
from megatron.core import tensor_parallel
from megatron_world import policy

from nemo_rz import ops
from nemo_rz.runtime.megatron import bridge, distributed, layers
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.nemo_rl_policy import VocabParallelLogprobs

HEAD_VOCAB = 1021  # odd (padded across two ranks), and wide enough that NeMo RL's exp-sum rounds differently


def head_model():
    return tiny_model(6, vocab_size=HEAD_VOCAB, hidden_size=256, intermediate_size=256, num_layers=2, dtype="bfloat16",
                      tie_word_embeddings=False)  # a hidden size where bfloat16 GEMMs round differently


def batch():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, HEAD_VOCAB, (3, 13), generator=g)


def nemo_rl_logprobs(shard: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """NeMo RL's from_parallel_logits_to_logprobs (TP, no CP, no chunking): float32 shard logits, the max and the
    exp-sum all-reduced over the ranks, the target's logprob taken on the rank that holds it and all-reduced."""
    x = shard[:, :-1].float()
    target = ids[:, 1:]
    start = dist.get_rank(group) * x.shape[-1]
    outside = (target < start) | (target >= start + x.shape[-1])
    local = (target - start).masked_fill(outside, 0)
    top = x.amax(-1, keepdim=True)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    x = x - top
    total = x.exp().sum(-1, keepdim=True).float()
    dist.all_reduce(total, group=group)
    lp = (x - total.log()).gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
    dist.all_reduce(lp, group=group)
    return lp


def main(out: str) -> None:
    distributed.init(Layout(tp=2))
    model = head_model()
    ids = batch()
    with ops.use_kernels("consistent"), torch.no_grad():
        p = policy(model, "consistent")
        gpt, group = p.gpt, p.tp
        mine = gpt.output_layer.weight.detach().clone()  # this rank's rows of the (padded) output weight
        stock = tensor_parallel.ColumnParallelLinear(
            mine.shape[1], mine.shape[0] * 2, config=gpt.config, init_method=gpt.config.init_method, bias=False,
            gather_output=False, tp_group=group)
        stock.weight.copy_(mine)
        gpt.output_layer = stock  # what the GPTModel NeMo RL's provider builds holds
        bridge.consistent_output_layer([gpt])  # the hook install_output_layer adds to NeMo RL's setup
        hooked = isinstance(gpt.output_layer, layers.ColumnLinear) and torch.equal(gpt.output_layer.weight, mine)
        logits = p._logits(ids)
        head = VocabParallelLogprobs(HEAD_VOCAB)
        got = {"consistent": head(logits, ids), "nemo_rl": nemo_rl_logprobs(logits, ids, group), "hooked": hooked}
        parts = [torch.empty_like(logits) for _ in range(2)]
        dist.all_gather(parts, logits.contiguous(), group=group)
        swapped = torch.cat(parts[::-1], -1)[:, :-1, :HEAD_VOCAB].reshape(-1, HEAD_VOCAB)
        got["swapped"] = ops.token_logprobs(swapped, ids[:, 1:].reshape(-1)).view(3, 12)
    ranks = [None, None]
    dist.all_gather_object(ranks, got)
    if dist.get_rank() == 0:
        torch.save({k: [r[k] for r in ranks] for k in ("consistent", "nemo_rl", "swapped", "hooked")}, out)


if __name__ == "__main__":
    main(sys.argv[1])
