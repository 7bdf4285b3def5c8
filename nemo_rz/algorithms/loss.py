"""REINFORCE Zero loss and the PPO-clip baseline, both seq-mean-token-mean.

REINFORCE Zero (docs/contracts.md, 3), B responses, T_i valid tokens in response i:
    L = -(1/B) * sum_i (1/T_i) * sum_t w_t * A_i * lp_learner_t,   w_t = sg(rho_t) (or a baseline correction)
so dL/d lp_learner_t = -(1/B) (1/T_i) w_t A_i: the weight is a constant, the gradient is plain REINFORCE's
scaled by it. A response with T_i = 0 contributes 0 (no division by zero); B counts every response.
"""
from __future__ import annotations

import torch

from nemo_rz.algorithms.corrections import importance_weights
from nemo_rz.metrics import mismatch_metrics


def _prepare(name: str, lp: torch.Tensor, other: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks shapes; returns (valid [B, T] bool, advantages as [B, T])."""
    if lp.dim() != 2 or lp.shape != other.shape or lp.shape != mask.shape:
        raise ValueError(f"{name}: logprobs {tuple(lp.shape)}, {tuple(other.shape)} and mask {tuple(mask.shape)} "
                         "must all be the same [B, T]")
    if lp.shape[0] == 0:
        raise ValueError(f"{name}: empty batch (B = 0); pass at least one response")
    adv = torch.as_tensor(advantages, device=lp.device)
    if adv.shape == lp.shape[:1]:
        adv = adv.unsqueeze(1).expand_as(lp)
    elif adv.shape != lp.shape:
        raise ValueError(f"{name}: advantages {tuple(adv.shape)} must be [B] = {tuple(lp.shape[:1])} or "
                         f"[B, T] = {tuple(lp.shape)}")
    valid = mask.detach() != 0
    bad = valid & ~torch.isfinite(adv.detach())
    if bad.any():
        r, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}: {int(bad.sum())} valid token(s) have a non-finite advantage, first at "
                         f"(row {r}, token {t}); check the rewards")
    bad = valid & ~torch.isfinite(lp.detach())
    if bad.any():
        r, t = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"{name}: {int(bad.sum())} valid token(s) have a non-finite learner logprob, first at "
                         f"(row {r}, token {t}) = {lp[r, t].item()}; check the model's logits")
    return valid, adv.detach()


def seq_mean_token_mean(per_token: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(1/B) sum_i (1/T_i) sum_t per_token[i, t] over valid t; rows with T_i = 0 give 0."""
    per_token = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    t_i = valid.sum(dim=1).clamp(min=1).to(per_token.dtype)
    return (per_token.sum(dim=1) / t_i).sum() / valid.shape[0]


def _gap_metrics(lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor,
                 rejected: torch.Tensor) -> dict[str, float]:
    m = mismatch_metrics(lp, ref, mask)
    n = max(int(valid.sum()), 1)
    m["rejection_rate"] = int((rejected & valid).sum()) / n
    return m


def reinforce_zero_loss(learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                        advantages: torch.Tensor, mask: torch.Tensor, correction: str = "unclipped",
                        **params) -> tuple[torch.Tensor, dict[str, float]]:
    """L = -(1/B) sum_i (1/T_i) sum_t w_t A_i lp_learner_t with w from `correction` (detached).

    learner_logprobs [B, T] (with grad), rollout_logprobs [B, T] (recorded by the engine), advantages [B]
    or [B, T], mask [B, T] (1 = valid). `params` go to the correction (e.g. C=2.0 for tis).
    Metrics: loss, weight_mean, weight_max, rejection_rate and mismatch_metrics (is_dev, rho_min,
    rho_max, k1, k2, k3, ...) of learner vs rollout over valid tokens.
    """
    w, rejected = importance_weights(learner_logprobs, rollout_logprobs, mask, correction, **params)
    valid, adv = _prepare("reinforce_zero_loss", learner_logprobs, rollout_logprobs, advantages, mask)
    lp = torch.where(valid, learner_logprobs, torch.zeros_like(learner_logprobs))   # padding may be -inf
    loss = -seq_mean_token_mean(w * adv * lp, valid)
    metrics = _gap_metrics(learner_logprobs, rollout_logprobs, mask, valid, rejected)
    wv = w[valid]
    metrics.update(loss=loss.item(), weight_mean=wv.mean().item() if wv.numel() else 0.0,
                   weight_max=wv.max().item() if wv.numel() else 0.0)
    return loss, metrics


def ppo_clip_loss(learner_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None
                  ) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip with the same normalisation: L = -(1/B) sum_i (1/T_i) sum_t min(r_t A, clip(r_t) A).

    r_t = exp(lp_learner_t - lp_old_t) carries the gradient (old is detached);
    clip(r) = clamp(r, 1 - clip_eps, 1 + clip_eps_high), clip_eps_high defaulting to clip_eps (DAPO's
    clip-higher when larger). rejection_rate = clip_fraction = share of valid tokens where the clipped
    term is the smaller one, i.e. whose gradient the clip removes.
    """
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    if not (0 <= clip_eps < 1 and hi >= 0):
        raise ValueError(f"ppo_clip_loss: need 0 <= clip_eps < 1 and clip_eps_high >= 0, got {clip_eps}, {hi}")
    importance_weights(learner_logprobs, old_logprobs, mask, "unclipped")   # raises on a non-finite ratio
    valid, adv = _prepare("ppo_clip_loss", learner_logprobs, old_logprobs, advantages, mask)
    log_r = torch.where(valid, learner_logprobs - old_logprobs.detach(), torch.zeros_like(learner_logprobs))
    ratio = torch.exp(log_r)
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - clip_eps, 1.0 + hi) * adv
    clipped = valid & (surr2 < surr1).detach()
    loss = -seq_mean_token_mean(torch.minimum(surr1, surr2), valid)
    metrics = _gap_metrics(learner_logprobs, old_logprobs, mask, valid, clipped)
    metrics.update(loss=loss.item(), clip_fraction=metrics["rejection_rate"])
    return loss, metrics


def ppo_clip(learner_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, correction: str = "unclipped", **params) -> tuple[torch.Tensor, dict[str, float]]:
    """The registered loss `ppo_clip`: ppo_clip_loss at its default clip. The clip is PPO's own correction, so
    `correction` and its params (checked by the Learner like any loss's) are not applied."""
    return ppo_clip_loss(learner_logprobs, old_logprobs, advantages, mask)
