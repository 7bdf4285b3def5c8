"""One rank of the multi-process Megatron checks in test_megatron.py (started by launch.start, 2 ranks):
TP=2 logprobs in both kernel sets, then a DP=2 learner update; rank 0 saves what it got to argv[1]."""
import sys

import torch
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.algorithms.advantages import group_advantages
from nemo_rz.generation.packing import Packed
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.learner import MegatronLearner
from nemo_rz.runtime.megatron.model import MegatronPolicy

VOCAB = 47  # not a multiple of 2: the vocabulary is padded across ranks


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (6, 13), generator=g)
    return ids, torch.tensor([13, 9, 5, 13, 2, 11])


def rl_batch() -> tuple[Packed, torch.Tensor]:
    ids, lengths = batch(2)
    mask = (torch.arange(12)[None, :] >= 3) & (torch.arange(12)[None, :] < lengths[:, None] - 1)
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(6, 12, generator=g) * mask
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    return Packed(ids, lengths, rollout, mask.float()), group_advantages(rewards, 3)


def learner(mirror, dp: int, grad_shares: int) -> MegatronLearner:
    return MegatronLearner(mirror, Layout(dp=dp, grad_shares=grad_shares), 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})


def main(out: str) -> None:
    torch.set_num_threads(1)
    model = tiny_model(0, vocab_size=VOCAB)
    ids, lengths = batch()
    got = {}
    distributed.init(Layout(tp=2))
    for mode in ("consistent", "fast"):
        with ops.use_kernels(mode):
            policy = MegatronPolicy(model.config)
            policy.load_state_dict(model.state_dict())
            got[f"tp2_{mode}"] = policy.token_logprobs(ids, lengths).detach()
            got[f"tp2_{mode}_weights"] = policy.state_dict()
    distributed.init(Layout(dp=2))
    with ops.use_kernels("consistent"):
        if torch.distributed.get_rank():
            MegatronLearner.follow()
        else:
            lrn = learner(model, 2, 2)
            metrics, _ = lrn.rl_step(*rl_batch())
            got["dp2_grads"] = [p.grad.clone() for p in lrn.model.parameters()]
            got["dp2_weights"] = lrn.state_dict_copy()
            lrn.stop()
    if torch.distributed.get_rank() == 0:
        torch.save(got, out)


if __name__ == "__main__":
    main(sys.argv[1])
