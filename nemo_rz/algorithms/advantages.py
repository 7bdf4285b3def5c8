"""Group-relative advantages.

REINFORCE Zero (docs/contracts.md, 3): A_i = r_i - mean(r over i's group), no std division.
Groups are consecutive runs of `group_size` responses (all samples of one prompt sit together).
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = False,
                     eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i - mean_g(r); with normalize_std, A_i = (r_i - mean_g(r)) / (std_g(r) + eps).

    rewards: [N] with N a multiple of group_size; group g holds rewards[g*G:(g+1)*G].
    std is the population std (correction 0) so a group of one gives A = 0, not nan.
    The std variant is the GRPO baseline kept for comparison; REINFORCE Zero uses the default.
    """
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_advantages: group_size must be a positive int, got {group_size!r}; "
                         "pass the number of samples per prompt")
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D [N], got shape {tuple(rewards.shape)}; "
                         "flatten to one reward per response")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(f"group_advantages: {n} rewards do not split into groups of {group_size}; "
                         "pass a batch of whole groups (N = prompts * group_size)")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = ~torch.isfinite(rewards)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"group_advantages: {int(bad.sum())} non-finite reward(s), first at index {i} "
                         f"(value {rewards[i].item()}); fix the reward function or drop the response")
    g = rewards.reshape(-1, group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (g.std(dim=1, correction=0, keepdim=True) + eps)
    return adv.reshape(n)
