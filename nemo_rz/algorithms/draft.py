"""Online draft co-training: the draft learns from the features the learner's RL forward already computed.

Each update hands the draft the batch's auxiliary-layer features and final hidden states (detached: no
gradient reaches the policy) and the batch's tokens; the draft takes one step of its own Adam on its
training-time-test loss, distilled from the target's distribution. A fresh draft with a reduced vocabulary takes
it from the completion tokens of the first batch it trains on. A frozen draft (mode "frozen") only reports the
same numbers.

The acceptance numbers are estimates from the batch itself: the rollout sampled each completion token x from
the target p, so mean(min(1, q(x) / p(x))) over the batch estimates the acceptance rate sum_x min(p, q) of
rejection sampling at that draft step (q: the draft's distribution at the teacher-forced prefix).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nemo_rz.algorithms.aux_loss import padded
from nemo_rz.errors import DivergenceError
from nemo_rz.models.decoder import packed_rows
from nemo_rz.models.draft import DraftHead, expected_tokens_per_pass
from nemo_rz.parallel.context import cp_draft_loss, reduce_gradients

MODES = ("off", "cotrain", "frozen")


def summary(metrics: dict[str, float], k: int) -> dict[str, float]:
    """Per-step numbers -> the logged ones: draft_loss, draft_accept_rate (accepted / proposed),
    draft_accepted_len (accepted draft tokens per verify pass) and draft_tokens_per_pass (what one target pass
    emits: the ideal speed-up, before the draft's own cost)."""
    steps = sorted(int(key.rsplit("_", 1)[1]) for key in metrics if key.startswith("draft_loss_"))
    out = {"draft_loss": sum(metrics[f"draft_loss_{s}"] for s in steps) / len(steps)} if steps else {}
    accept = [metrics[f"draft_accept_{s}"] for s in steps if f"draft_accept_{s}" in metrics]
    if accept:
        accept = (accept + [accept[-1]] * k)[:k]  # steps past the trained depth: as the deepest trained one
        per_pass = expected_tokens_per_pass(accept)
        out.update(draft_accept_rate=(per_pass - 1) / k, draft_accepted_len=per_pass - 1, draft_tokens_per_pass=per_pass)
    return out


class DraftTrainer:
    """The draft as the learner's auxiliary loss (algorithms.aux_loss.AuxLoss): it taps the learner's forward for
    its auxiliary layers' features and the final hidden states, and ships its weights with every version."""

    name = "draft"

    def __init__(self, draft: DraftHead, mode: str, lr: float, loss_weight: float, steps: int, k: int,
                 grad_clip: float | None = None, fresh: bool = True):
        if mode not in MODES[1:]:
            raise ValueError(f"draft.mode = {mode!r}: a DraftTrainer is for cotrain or frozen")
        if steps < 1:
            raise ValueError(f"draft.steps = {steps}: must be >= 1")
        self.draft, self.mode, self.steps, self.k = draft, mode, steps, k
        self.lr, self.loss_weight, self.grad_clip = lr, loss_weight, grad_clip
        self.opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=lr) if mode == "cotrain" else None
        self.vocab_pending = fresh and self.opt is not None and not draft.full_vocab  # chosen by the first step

    def tap(self, model):
        return self.draft.tap(model, final=True)

    def learn(self, model, tapped: list, batch, temperature: float, what: str = "draft") -> dict[str, float]:
        """The auxiliary-loss step: `step` on the features of the learner's one forward of this batch; where the
        forward ran over context-parallel ranks (`model.context_group`: the Megatron learner's TapView under
        megatron.cp), `context_step` on this rank's own tokens."""
        group = getattr(model, "context_group", None)
        if group is not None:
            return self.context_step(model, *tapped[0], batch, temperature, group, what)
        aux, final = (padded(x, batch) for x in tapped[0])  # the learner's forward is packed
        return self.step(model, aux, batch.input_ids, batch.mask, temperature, batch.rollout_logprobs, what, final)

    def context_step(self, target, aux: torch.Tensor, final: torch.Tensor, batch, temperature: float, group,
                     what: str = "draft") -> dict[str, float]:
        """`step` over the ranks of `group`, which split the batch's sequences, packed into one row
        (models.decoder.packed_rows), by parallel.context's zigzag shard; `aux` and `final` are this rank's own
        tokens' features, in the shard's order. Every rank of the group calls it with the same batch: the draft's
        training-time test runs through the ring and rank-local branch attention (parallel.context.cp_draft_loss),
        the ranks' gradients are added in a fixed tree over the group (reduce_gradients), and each rank's optimizer
        takes the same step. The loss and metrics are `step`'s bits; the gradients equal its within float32
        rounding (each rank's products sum over its own roots, then the ranks' parts are added)."""
        b, length = batch.input_ids.shape
        rows = packed_rows(batch.lengths, length)
        cu = [0, *torch.cumsum(batch.lengths, 0).tolist()]
        def row(x):  # [B, T-1] -> the packed row's [sum(lengths)] (0 at each sequence's last token)
            return None if x is None else F.pad(x, (0, 1)).reshape(-1)[rows]
        train = self._begin(batch.input_ids, batch.mask)
        with torch.enable_grad() if train else torch.no_grad():
            part, loss, m = cp_draft_loss(self.draft, target, aux.detach(), final.detach(), batch.input_ids.reshape(-1)[rows],
                                          row(batch.mask), cu, self.steps, temperature, group, row(batch.rollout_logprobs))
        self._finish(part, loss, what, lambda: reduce_gradients(self.draft, group))
        return summary(m, self.k)

    def shipped(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.draft.state_dict().items()}

    def receive(self, weights: dict[str, torch.Tensor]) -> None:
        self.draft.load_state_dict(weights)

    def step(self, target, aux: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor, temperature: float,
             rollout_logprobs: torch.Tensor | None = None, what: str = "draft",
             final: torch.Tensor | None = None) -> dict[str, float]:
        """One co-training step (cotrain) or only its numbers (frozen) on a batch's target features `aux` (and
        final hidden states `final`, for distillation); returns the summary metrics."""
        train = self._begin(input_ids, mask)
        final = None if final is None else final.detach()
        with torch.enable_grad() if train else torch.no_grad():
            loss, m = self.draft.training_loss(target, aux.detach(), input_ids, mask, self.steps, temperature,
                                               rollout_logprobs, final)
        self._finish(loss, loss, what)
        return summary(m, self.k)

    def _begin(self, input_ids: torch.Tensor, mask: torch.Tensor) -> bool:
        """Before a step's loss: a fresh draft's vocabulary from the batch; whether the step trains."""
        train = self.opt is not None
        if self.vocab_pending:
            self.draft.choose_vocab(input_ids[:, 1:][mask.bool()])
            self.vocab_pending = False
        self.draft.train(train)
        return train

    def _finish(self, part: torch.Tensor | None, loss: torch.Tensor | None, what: str, reduce=None) -> None:
        """The optimizer step on `part` (this process's part of `loss`; `reduce()` then adds the processes' gradients
        up), guarded by the whole loss and the gradient norm."""
        if loss is not None and self.opt is not None:
            if not torch.isfinite(loss):
                raise DivergenceError(f"{what}: the draft's loss is {loss.item()}")
            self.opt.zero_grad(set_to_none=True)
            (self.loss_weight * part).backward()
            if reduce is not None:
                reduce()
            norm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), self.grad_clip or math.inf)
            if not torch.isfinite(norm):
                raise DivergenceError(f"{what}: the draft's gradient norm is {norm.item()}")
            self.opt.step()
        self.draft.eval()

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "vocab_pending": self.vocab_pending} if self.opt is not None else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore the draft's optimizer; draft.lr as configured now replaces the saved learning rate."""
        if self.opt is not None and state:
            self.opt.load_state_dict(state["optimizer"])
            self.vocab_pending = state["vocab_pending"]
            for g in self.opt.param_groups:
                g["lr"] = self.lr
