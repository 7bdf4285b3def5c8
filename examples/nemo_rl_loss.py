"""REINFORCE Zero inside NeMo RL: the loss function plugs in through NeMo RL's LossFunction protocol.

NeMo RL has no plugin registry; its GRPO setup builds `ClippedPGLossFn(loss_config)`. Swap in
`ReinforceZeroLossFn()` there (one line), and set NeMo RL's generation to record logprobs with nemo-rz's
vLLM backend or built-in engine. This script feeds the loss a NeMo-RL-shaped microbatch made from real
rollouts of the built-in engine, split into microbatches as NeMo RL does, and shows that the summed
microbatch losses equal the full batch's (global normalisation).

    python examples/nemo_rl_loss.py
"""
import torch

from nemo_rz.algorithms import ReinforceZeroLossFn, group_advantages
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import Decoder, DecoderConfig

torch.manual_seed(0)
model = Decoder(DecoderConfig(vocab_size=32))
engine = RolloutEngine(model)
prompts = [[1, 5, 7], [1, 9, 9, 3]] * 4  # two prompts, group size 4
outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, seed=0))
batch = pack(outs)
rewards = torch.tensor([float(o.token_ids[0] % 2) for o in outs])  # a stand-in verifier
adv = group_advantages(rewards.view(2, 4).t().reshape(-1), group_size=4)  # rows ordered per group

# NeMo RL's data layout: token tensors [B, S] aligned with input_ids, sliced [:, 1:] inside the loss.
pad = torch.zeros(batch.input_ids.shape[0], 1)
data = {
    "input_ids": batch.input_ids,
    "token_mask": torch.cat([pad, batch.mask], 1),
    "sample_mask": torch.ones(len(outs)),
    "generation_logprobs": torch.cat([pad, batch.rollout_logprobs], 1),
    "prev_logprobs": torch.cat([pad, batch.rollout_logprobs], 1),
    "advantages": adv[:, None].expand_as(batch.input_ids).clone(),
}
loss_fn = ReinforceZeroLossFn(correction="unclipped")
lp = model.token_logprobs(batch.input_ids, batch.lengths)
seqs, toks = torch.tensor(float(len(outs))), batch.mask.sum()
full, metrics = loss_fn(data, seqs, toks, next_token_logprobs=lp)
halves = [loss_fn({k: v[s] for k, v in data.items()}, seqs, toks, next_token_logprobs=lp[s])[0] for s in (slice(0, 4), slice(4, 8))]
print(f"loss_type={loss_fn.loss_type.value} input_type={loss_fn.input_type.value}")
print(f"full batch loss {full.item():.6f} = sum of microbatch losses {sum(halves).item():.6f}")
print(f"is_dev {metrics['is_dev']:.3g} (0: rollout and learner logprobs are bit-identical, same weights)")
