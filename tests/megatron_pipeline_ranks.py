"""One rank of the pipeline-parallel Megatron checks in test_megatron_pipeline.py (started by launch.start, 2
ranks, one launch): PP=2 logprobs through Megatron's schedule in both kernel sets, PP=2 learner updates with 2
micro-batches (with a co-trained draft fed across stages) and with 1, a tied model at PP=2, a mixture of experts
(moe_tiny's shape) at PP=2: logprobs, the routing record over stages and updates with decompose's routing
comparison, and TP=2 and DP=2 updates with the draft. Rank 0 saves what it got to argv[1]."""
import sys

import torch
from conftest import tiny_model
from megatron_moe_ranks import moe_model, updates
from megatron_ranks import rl_batch

from nemo_rz import ops
from nemo_rz.algorithms.draft import DraftTrainer
from nemo_rz.models.draft import DraftHead
from nemo_rz.models.moe import recorded_routing
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.data_parallel import DataParallel
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.learner import MegatronLearner
from nemo_rz.runtime.megatron.model import MegatronPolicy

VOCAB, LAYERS, AUX = 47, 4, (0, 2, 3)  # AUX: layer 0 on stage 0 (rank 0's), layers 2, 3 and the final norm on stage 1


def model(**kw):
    return tiny_model(0, vocab_size=VOCAB, num_layers=LAYERS, **kw)


def moe_tiny(seed: int = 0, attention: bool = True):
    """conf/moe_tiny.yaml's model shape: 2 layers (one per stage at PP=2), 4 experts, k=2, and (attention) a
    sliding window in layer 0 and attention sinks (which Megatron's own attention, the fast kernels, has not)."""
    extra = dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"], attention_sinks=True)
    return moe_model(seed, num_layers=2, moe_intermediate_size=96, **(extra if attention else {}))


def draft(mirror) -> DraftTrainer:
    torch.manual_seed(5)
    return DraftTrainer(DraftHead(mirror.config, AUX, num_layers=1), "cotrain", 1e-3, 1.0, steps=2, k=3, grad_clip=1.0)


def learner(mirror, layout: Layout) -> MegatronLearner:
    return MegatronLearner(mirror, layout, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})


def update(layout: Layout, with_draft: bool = False, **kw) -> dict | None:
    """One RL update on every rank; rank 0 returns what it saw."""
    if torch.distributed.get_rank():
        MegatronLearner.follow()
        return None
    mirror = model(**kw)
    lrn = learner(mirror, layout)
    if with_draft:
        lrn.add_aux_loss(draft(mirror))
    metrics, lp = lrn.rl_step(*rl_batch())
    out = dict(metrics=metrics, lp=lp, grads=lrn.gradients(), weights=lrn.state_dict_copy(),
               mirror={k: v.clone() for k, v in mirror.state_dict().items()})
    if with_draft:
        out["draft"] = lrn.draft.shipped()
    lrn.stop()
    return out


def main(out: str) -> None:
    torch.set_num_threads(1)
    got = {}
    ids, lengths = rl_batch()[0].input_ids, rl_batch()[0].lengths
    distributed.init(Layout(pp=2))
    for mode in ("consistent", "fast"):
        with ops.use_kernels(mode):
            policy = MegatronPolicy(model().config)
            policy.load_state_dict(model().state_dict())
            with torch.no_grad():
                got[f"pp2_{mode}"] = DataParallel(policy, 2, distributed.dp_group()).token_logprobs(ids, lengths)
            got[f"pp2_{mode}_weights"] = policy.state_dict()
    for mode in ("consistent", "fast"):  # a mixture of experts over the stages
        with ops.use_kernels(mode):
            mirror = moe_tiny(attention=mode == "consistent")
            policy = MegatronPolicy(mirror.config)
            policy.load_state_dict(mirror.state_dict())
            with torch.no_grad(), recorded_routing(policy) as routing:
                got[f"pp2_moe_{mode}"] = DataParallel(policy, 2, distributed.dp_group()).token_logprobs(ids, lengths)
            got[f"pp2_moe_{mode}_routing"] = {name: [e.clone() for e in log] for name, log in routing.items()}
            got[f"pp2_moe_{mode}_weights"] = policy.state_dict()
    with ops.use_kernels("consistent"):
        got["pp2_moe_updates"] = updates(moe_tiny(), Layout(pp=2, grad_shares=2))
        got["pp2_shares2"] = update(Layout(pp=2, grad_shares=2), with_draft=True)
        got["pp2_shares1"] = update(Layout(pp=2, grad_shares=1))
        got["pp2_tied"] = update(Layout(pp=2, grad_shares=2), tie_word_embeddings=True)
        distributed.init(Layout(tp=2))
        got["tp2_draft"] = update(Layout(tp=2), with_draft=True)
        distributed.init(Layout(dp=2))
        got["dp2_draft"] = update(Layout(dp=2), with_draft=True)  # rank 1's share's features cross replicas
    if torch.distributed.get_rank() == 0:
        torch.save(got, out)


if __name__ == "__main__":
    main(sys.argv[1])
