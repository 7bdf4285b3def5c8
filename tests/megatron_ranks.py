"""One rank of the multi-process Megatron checks in test_megatron.py (started by launch.start, 2 ranks):
TP=2 logprobs in both kernel sets, every dense family's and every precision recipe's TP=2 logprobs (consistent),
families over PP=2, then a DP=2 learner update; rank 0 saves what it got to argv[1]."""
import sys

import torch
from conftest import tiny_model

from nemo_rz import ops
from nemo_rz.algorithms.advantages import group_advantages
from nemo_rz.generation.packing import Packed
from nemo_rz.quant.linear import RECIPES
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron import precision as megatron_precision
from nemo_rz.runtime.megatron.data_parallel import DataParallel
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.learner import MegatronLearner
from nemo_rz.runtime.megatron.model import MegatronPolicy

VOCAB = 47  # not a multiple of 2: the vocabulary is padded across ranks


_WINDOWS = dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"])
# Each dense family's features on the tiny model (with_values: non-zero biases, sinks and norms), and for each the
# settings that turn one feature off: each must change the Decoder's logprobs on `batch()` (test_megatron.py),
# so the Megatron learner's equality with the Decoder shows it runs that feature.
FAMILIES = {
    "gemma3": (dict(norm="gemma", sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True, query_pre_attn_scalar=24.0,
                    rope_theta=1e6, rope_local_theta=1e4, tie_word_embeddings=True, **_WINDOWS),
               [dict(norm="rms"), dict(sandwich_norm=False), dict(hidden_act="silu"), dict(embed_scale=False),
                dict(rope_local_theta=None), dict(query_pre_attn_scalar=None), dict(layer_types=None, sliding_window=None)]),
    "mistral": (dict(qk_norm=False, sliding_window=4), [dict(sliding_window=None)]),
    "qwen2-window-mix": (dict(qk_norm=False, attention_bias=True, sliding_window=4,
                              layer_types=["full_attention", "sliding_attention"]),
                         [dict(layer_types=None), dict(layer_types=None, sliding_window=None)]),
    # float32-weight norms differ from the plain ones in bfloat16 only
    "gpt-oss-attention": (dict(qk_norm=False, attention_bias=True, o_proj_bias=True, attention_sinks=True, norm="rms_f32",
                               dtype="bfloat16", rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8),
                               **_WINDOWS),
                          [dict(attention_sinks=False), dict(rope_scaling=None), dict(o_proj_bias=False), dict(norm="rms"),
                           dict(layer_types=None, sliding_window=None)]),
}
FAMILIES["gemma3-bf16"] = ({**FAMILIES["gemma3"][0], "dtype": "bfloat16"}, FAMILIES["gemma3"][1])
FAMILIES["gpt-oss"] = ({**FAMILIES["gpt-oss-attention"][0], "num_experts": 4, "num_experts_per_tok": 2,  # its MoE: moe.py
                        "moe_intermediate_size": 32, "moe_kind": "gpt_oss"}, FAMILIES["gpt-oss-attention"][1])
TP2_FAMILIES = ("gemma3-bf16", "mistral", "qwen2-window-mix", "gpt-oss-attention")
PP2_FAMILIES = ("gemma3-bf16", "gpt-oss-attention")  # the embedding scale on stage 0, post norms, sinks
QUANT_MODEL = dict(qk_norm=False, attention_bias=True, o_proj_bias=True)  # every recipe, TP=1 and TP=2


def with_values(model):
    """model with every 1-d parameter (biases, sinks, norm weights) drawn too: zeros or ones would hide them."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.3)
    return model


def family_model(name: str):
    return with_values(tiny_model(0, vocab_size=VOCAB, **FAMILIES[name][0]))


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
    with ops.use_kernels("consistent"):
        for name in TP2_FAMILIES:
            fam = family_model(name)
            policy = MegatronPolicy(fam.config)
            policy.load_state_dict(fam.state_dict())
            got[f"tp2_{name}"] = policy.token_logprobs(ids, lengths).detach()
            got[f"tp2_{name}_weights"] = policy.state_dict()
        quant = with_values(tiny_model(0, vocab_size=VOCAB, **QUANT_MODEL))
        for recipe in ("bf16", *RECIPES):
            policy = MegatronPolicy(quant.config)
            policy.load_state_dict(quant.state_dict())
            got[f"tp2_quant_{recipe}"] = megatron_precision.apply_precision(policy, recipe).token_logprobs(ids, lengths).detach()
    distributed.init(Layout(pp=2))  # the families over 2 pipeline stages (Megatron's schedule: schedule.py)
    with ops.use_kernels("consistent"), torch.no_grad():
        for name in PP2_FAMILIES:
            fam = family_model(name)
            policy = MegatronPolicy(fam.config)
            policy.load_state_dict(fam.state_dict())
            got[f"pp2_{name}"] = DataParallel(policy, 1, distributed.dp_group()).token_logprobs(ids, lengths)
            got[f"pp2_{name}_weights"] = policy.state_dict()
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
