"""The learner role: the policy, its optimizer, and one update of REINFORCE Zero (or a baseline)."""
from __future__ import annotations

import math

import torch

from nemo_rz import algorithms
from nemo_rz.generation.packing import Packed
from nemo_rz.metrics import decomposition
from nemo_rz.models import Decoder


class NonFiniteError(ValueError):
    pass


class Learner:
    def __init__(self, model: Decoder, lr: float, grad_clip: float | None, temperature: float, loss: str,
                 correction: str, correction_params: dict, ppo_clip_eps: float = 0.2):
        if loss not in ("reinforce_zero", "ppo_clip"):
            raise ValueError(f"algo.loss = {loss!r}: use reinforce_zero or ppo_clip")
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.grad_clip, self.temperature, self.loss = grad_clip, temperature, loss
        self.correction, self.correction_params, self.ppo_clip_eps = correction, dict(correction_params), ppo_clip_eps

    def state_dict_copy(self) -> dict[str, torch.Tensor]:
        """A snapshot of the current weights (a published version must not change under a reader)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _apply(self, loss: torch.Tensor, what: str) -> float:
        if not torch.isfinite(loss):
            raise NonFiniteError(f"{what}: loss is {loss.item()}; lower the learning rate or check the data")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        if not torch.isfinite(norm):
            raise NonFiniteError(f"{what}: gradient norm is {norm.item()}; lower the learning rate or check the data")
        if norm > 0:  # no signal (all advantages 0, or every token rejected): Adam momentum must not move the policy
            self.opt.step()
        return float(norm)

    def rl_step(self, batch: Packed, advantages: torch.Tensor) -> tuple[dict[str, float], torch.Tensor]:
        """One update; returns its metrics and the learner logprobs it used (detached, pre-update weights)."""
        self.model.train()
        lp = self.model.token_logprobs(batch.input_ids, batch.lengths, self.temperature)
        if self.loss == "ppo_clip":
            loss, m = algorithms.ppo_clip_loss(lp, batch.rollout_logprobs, advantages, batch.mask, clip_eps=self.ppo_clip_eps)
        else:
            loss, m = algorithms.reinforce_zero_loss(lp, batch.rollout_logprobs, advantages, batch.mask, self.correction, **self.correction_params)
        m["grad_norm"] = self._apply(loss, "RL update")
        return m, lp.detach()

    def sft_step(self, ids: torch.Tensor, lengths: torch.Tensor, target_mask: torch.Tensor) -> float:
        """Supervised warm-up: mean negative log-likelihood of the target tokens."""
        self.model.train()
        lp = self.model.token_logprobs(ids, lengths)
        loss = -(lp * target_mask).sum() / target_mask.sum()
        self._apply(loss, "warm-up")
        return float(loss.detach())

    @torch.no_grad()
    def decompose(self, batch: Packed, weights_at_rollout: dict[str, torch.Tensor], current_lp: torch.Tensor | None = None) -> dict[str, float]:
        """Kernel mismatch alone (rollout vs learner at the rollout's own weights) and lag alone."""
        self.model.eval()
        now = self.model.token_logprobs(batch.input_ids, batch.lengths, self.temperature) if current_lp is None else current_lp
        current = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(weights_at_rollout)
        then = self.model.token_logprobs(batch.input_ids, batch.lengths, self.temperature)
        self.model.load_state_dict(current)
        return decomposition(batch.rollout_logprobs, now, then, batch.mask)
