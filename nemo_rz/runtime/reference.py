"""One synchronous REINFORCE Zero step, written out: the reference the asynchronous trainer must equal.

The trainer (runtime/trainer.py) does the same with the steps spread over processes: a rollout worker samples,
the trainer rewards and packs, the Learner (runtime/learner.py) computes logprobs, loss and step, adding
divergence checks. Given the same weights, prompts and seeds, an update of the trainer with max_lag = 0 equals
this function's bit for bit (tests/test_reference.py).
"""
from __future__ import annotations

import torch

from nemo_rz.algorithms import group_advantages, reinforce_zero_loss
from nemo_rz.generation import SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import Decoder
from nemo_rz.protocols import RolloutEngineProtocol
from nemo_rz.tasks import Problem, Task, safe_reward


def reinforce_zero_step(model: Decoder, optimizer: torch.optim.Optimizer, engine: RolloutEngineProtocol, task: Task,
                        problems: list[Problem], group_size: int, params: SamplingParams,
                        grad_clip: float | None = None, correction: str = "unclipped", **correction_params) -> dict:
    """Sample group_size responses per problem with `engine`, reward them, and take one optimizer step on
    `model` (the learner). The engine holds the weights that generate; with the learner's own weights the
    importance weights are exactly 1. Returns the loss's metrics, the rewards and the gradient norm."""
    # 1. Sample: every prompt group_size times. The engine records log-softmax(logits / T) at each sampled token.
    prompts = [task.encode_prompt(p.prompt) for p in problems for _ in range(group_size)]
    completions = engine.generate(prompts, params)

    # 2. Reward: the task's verifier scores each response against its problem's answer (a verifier that
    #    raises costs that sample its reward, not the run).
    answers = [p.answer for p in problems for _ in range(group_size)]
    rewards = torch.tensor([safe_reward(task.reward, c.token_ids, a)[0] for c, a in zip(completions, answers)])

    # 3. Advantages: reward minus the mean reward of the same prompt's group, no std division.
    advantages = group_advantages(rewards, group_size)

    # 4. Learner logprobs: prompt + response through the learner's forward, with autograd, at the same
    #    temperature (0 means greedy, whose logprobs are recorded at temperature 1).
    batch = pack(completions)
    model.train()
    learner_lp = model.token_logprobs(batch.input_ids, batch.lengths, params.temperature or 1.0)

    # 5. Loss: -(1/B) sum_i (1/T_i) sum_t sg(rho_t) A_i lp_t, rho_t = exp(learner - rollout) unclipped.
    loss, metrics = reinforce_zero_loss(learner_lp, batch.rollout_logprobs, advantages, batch.mask, correction,
                                        **correction_params)

    # 6. Step: gradient, clipped by its norm; no step without a gradient (Adam's momentum would still move).
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    if grad_norm > 0:
        optimizer.step()
    return dict(metrics, rewards=rewards.tolist(), grad_norm=float(grad_norm))
