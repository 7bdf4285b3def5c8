"""The learner role: the policy, its optimizer, and one update of REINFORCE Zero (or a baseline)."""
from __future__ import annotations

import contextlib
import math

import torch

from nemo_rz import algorithms, plugins
from nemo_rz.algorithms import aux_loss
from nemo_rz.errors import DivergenceError
from nemo_rz.generation.packing import Packed
from nemo_rz.metrics import decomposition, routing_diff_tokens
from nemo_rz.models import Decoder
from nemo_rz.models.decoder import Packing
from nemo_rz.models.moe import recorded_routing
from nemo_rz.runtime.weights import WeightsBundle

LOSSES = plugins.names("loss")  # every registered loss: the built-ins (reinforce_zero, ppo_clip), then plugins'
# What the trainer reads from a loss's metrics (docs/plugins.md: a plugin loss must report them too).
LOSS_METRICS = ("loss", "is_dev", "k1", "k3", "rho_min", "rho_max", "rejection_rate")
# A stable step moves the weights by a small fraction of their norm (about 0.3% at the default learning
# rate): a step that more than doubles the whole norm is divergence, even while the weights are finite.
MAX_WEIGHT_GROWTH = 2.0


def weight_norm(model: torch.nn.Module) -> float:
    """L2 norm of all parameters; a tensor whose float32 norm overflows (huge weights) is redone in float64."""
    total = 0.0
    for p in model.parameters():
        n = torch.linalg.vector_norm(p.detach())
        if not torch.isfinite(n):
            n = torch.linalg.vector_norm(p.detach(), dtype=torch.float64)
        total += float(n) ** 2
    return math.sqrt(total)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer holds: all of them, or a LoRA model's adapters alone (models/lora.py)."""
    return [p for p in model.parameters() if p.requires_grad]


class Learner:
    def __init__(self, model: Decoder, lr: float, grad_clip: float | None, temperature: float, loss: str,
                 correction: str, correction_params: dict):
        # Here, before any step, rather than at the first RL update (a plugin that fails to load says so itself).
        self.loss_fn = plugins.load("loss", loss)
        algorithms.corrections.correction(correction)
        try:
            algorithms.correction_params(correction, correction_params)
        except ValueError as e:
            raise ValueError(f"algo.correction_params: {e}") from None
        self.model, self.lr = model, lr
        self.opt = torch.optim.Adam(trainable(model), lr=lr)
        self.grad_clip, self.temperature, self.loss = grad_clip, temperature, loss
        self.correction, self.correction_params = correction, dict(correction_params)
        self.aux_losses: list[aux_loss.AuxLoss] = []  # fed by the RL forward's features (a co-trained draft)

    @contextlib.contextmanager
    def supervised(self, lr: float):
        """Supervised (warm-up) steps inside the block use their own Adam at `lr`; RL then starts with a fresh
        one, since warm-up moments would otherwise steer the first RL updates."""
        self.opt = torch.optim.Adam(trainable(self.model), lr=lr)
        try:
            yield
        finally:
            self.opt = torch.optim.Adam(trainable(self.model), lr=self.lr)

    def add_aux_loss(self, loss: aux_loss.AuxLoss) -> None:
        if any(a.name == loss.name for a in self.aux_losses):
            raise ValueError(f"an auxiliary loss named {loss.name!r} is already registered")
        self.aux_losses.append(loss)

    @property
    def draft(self):
        """The co-trained (or evaluated) draft's trainer, or None."""
        return next((a for a in self.aux_losses if a.name == "draft"), None)

    @draft.setter
    def draft(self, trainer) -> None:
        self.aux_losses = [a for a in self.aux_losses if a.name != "draft"] + ([trainer] if trainer is not None else [])

    def optimizer_state(self) -> dict:
        """The policy's optimizer, and each auxiliary loss's state under its name."""
        return {**self.opt.state_dict(), **{a.name: a.state_dict() for a in self.aux_losses}}

    def load_optimizer_state(self, state: dict, lr: float) -> None:
        """Restore a saved optimizer; `lr` replaces the saved learning rate (a resume may lower it)."""
        state = dict(state)
        for a in self.aux_losses:
            saved = state.pop(a.name, None)
            if saved is not None:
                a.load_state_dict(saved)
        self.opt.load_state_dict(state)
        self.lr = lr
        for g in self.opt.param_groups:
            g["lr"] = lr

    def state_dict_copy(self) -> dict[str, torch.Tensor]:
        """A snapshot of the policy's current weights (a published version must not change under a reader); frozen
        parameters (a LoRA base) never change, so every version shares them uncopied."""
        frozen = {k for k, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        return {k: v.detach() if k in frozen else v.detach().clone() for k, v in self.model.state_dict().items()}

    def weights(self, version: int) -> WeightsBundle:
        """What version `version` ships: the policy's snapshot, and each auxiliary loss's weights (a draft's)."""
        parts = {a.name: w for a in self.aux_losses if (w := a.shipped()) is not None}
        return WeightsBundle(version, self.state_dict_copy(), parts)

    def receive(self, bundle: WeightsBundle) -> None:
        """The auxiliary losses take back their parts of a restored version."""
        for a in self.aux_losses:
            if a.name in bundle.parts:
                a.receive(bundle.parts[a.name])

    def _apply(self, loss: torch.Tensor, what: str) -> float:
        """Step on `loss`; DivergenceError on a non-finite loss or gradient norm, or on weights that the step
        made non-finite or exploded (the caller must then not keep them)."""
        if not torch.isfinite(loss):
            raise DivergenceError(f"{what}: loss is {loss.item()}")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip or math.inf)
        if not torch.isfinite(norm):
            raise DivergenceError(f"{what}: gradient norm is {norm.item()}")
        if norm > 0:  # no signal (all advantages 0, or every token rejected): Adam momentum must not move the policy
            before = weight_norm(self.model)
            self.opt.step()
            after = weight_norm(self.model)
            if not math.isfinite(after):
                raise DivergenceError(f"{what}: weights are not finite after the step (norm {after})")
            if before > 0 and after > MAX_WEIGHT_GROWTH * before:
                raise DivergenceError(f"{what}: weight norm grew from {before:.3g} to {after:.3g} in one step "
                                      f"(more than {MAX_WEIGHT_GROWTH:g}x)")
        return float(norm)

    def _logprobs(self, ids: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """The policy's logprobs [B, T-1] where `mask` is set, 0 elsewhere (the built-in Decoder runs the packed valid
        tokens and its LM head only there; Megatron's policy computes every position and zeroes the rest)."""
        return self.model.token_logprobs(ids, lengths, temperature, mask=mask)

    def rl_step(self, batch: Packed, advantages: torch.Tensor, what: str = "RL update") -> tuple[dict[str, float], torch.Tensor]:
        """One update; returns its metrics and the learner logprobs it used (detached, pre-update weights)."""
        self.model.train()
        with aux_loss.tapped(self.model, self.aux_losses) as taps:
            lp = self._logprobs(batch.input_ids, batch.lengths, batch.mask, self.temperature)
        valid = lp.detach()[batch.mask.bool()]
        nan, neg_inf = int(torch.isnan(valid).sum()), int(torch.isneginf(valid).sum())
        if nan:  # the learner's own numbers broke
            raise DivergenceError(f"{what}: the learner's logprobs are NaN on {nan} token(s) (weight norm {weight_norm(self.model):.3g})")
        if neg_inf:  # a sampled token the learner gives probability 0: its ratio is 0 and its gradient infinite
            raise DivergenceError(f"{what}: the learner's logprobs are -inf on {neg_inf} sampled token(s) "
                                  f"(weight norm {weight_norm(self.model):.3g})")
        loss, m = self.loss_fn(lp, batch.rollout_logprobs, advantages, batch.mask, self.correction, **self.correction_params)
        missing = [k for k in LOSS_METRICS if k not in m]
        if missing:
            raise ValueError(f"loss {self.loss!r} reported no {', '.join(missing)} in its metrics; see docs/plugins.md")
        # this forward's features, detached: no second pass of the policy, no gradient to it
        m.update(aux_loss.learn(self.model, self.aux_losses, taps, batch, self.temperature, what))
        m["grad_norm"] = self._apply(loss, what)
        return m, lp.detach()

    def sft_step(self, ids: torch.Tensor, lengths: torch.Tensor, target_mask: torch.Tensor, what: str = "warm-up") -> float:
        """Supervised warm-up: mean negative log-likelihood of the target tokens."""
        self.model.train()
        lp = self._logprobs(ids, lengths, target_mask)
        loss = -(lp * target_mask).sum() / target_mask.sum()
        self._apply(loss, what)
        return float(loss.detach())

    @torch.no_grad()
    def decompose(self, batch: Packed, weights_at_rollout: WeightsBundle, current_lp: torch.Tensor | None = None) -> dict[str, float]:
        """Kernel mismatch alone (rollout vs learner at the rollout's own weights) and lag alone."""
        self.model.eval()
        now = self._logprobs(batch.input_ids, batch.lengths, batch.mask, self.temperature) if current_lp is None else current_lp
        current = {k: v.clone() for k, v in self.model.state_dict().items()}
        self.model.load_state_dict(weights_at_rollout.policy)
        with recorded_routing(self.model) as routing:
            then = self._logprobs(batch.input_ids, batch.lengths, batch.mask, self.temperature)
        self.model.load_state_dict(current)
        out = decomposition(batch.rollout_logprobs, now, then, batch.mask)
        if batch.rollout_routing is not None and routing:
            b, length = batch.input_ids.shape
            # the built-in Decoder's forward ran the batch's Packing; Megatron's the padded batch
            packing = Packing.of(batch.input_ids, batch.lengths) if isinstance(self.model, Decoder) else None

            def padded(experts: torch.Tensor) -> torch.Tensor:
                # (a data-parallel policy's record may end with its padding rows: cut)
                return (packing.unpack(experts, -1) if packing else experts[: b * length]).view(b, length, -1)

            experts = torch.cat([padded(log[0]) for log in routing.values()], -1)[:, :-1]
            out["routing_diff_tokens"] = routing_diff_tokens(batch.rollout_routing, experts, batch.mask)
        return out
