"""The learner's auxiliary-loss hook: losses that learn from the features of the learner's own RL forward.

An auxiliary loss (the co-trained draft is the first; a DeepSeek-style multi-token-prediction head would be the
next) never costs a second pass of the policy. The learner enters every registered loss's `tap` around its one
forward (forward hooks on the layers the loss reads), then hands each loss what it tapped, with the batch, through
`learn`, before the policy's own optimizer step. A loss trains its own parameters with its own optimizer; what it
tapped is detached, so no gradient reaches the policy. Both learners (the built-in one and the Megatron one) run
the same hook: it is `Learner.rl_step`'s.

What a tap records is laid out as the forward ran: the built-in learner's forward is packed (the rows of the batch's
models.decoder.Packing: valid tokens only, a shared prefix once); `padded` gives it the batch's [B * T] layout.

A model whose layers a loss cannot hook as a Decoder's (the Megatron learner's: its layers are Megatron's, split
over ranks and stages) names a stand-in, `model.aux_target` (runtime/megatron/taps.py's TapView): the losses tap
and read that instead; its tap points get the model's features in the padded layout once the forward is done.

A loss's optimizer state travels in the learner's optimizer state under the loss's `name`; the weights it ships
with every weight version (a draft's) are `shipped()`, and `receive` takes them back from a checkpoint.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol, runtime_checkable

import torch

from nemo_rz.models.decoder import Packing


@runtime_checkable
class AuxLoss(Protocol):
    name: str  # its key in the optimizer state and in the weights bundle

    def tap(self, model) -> ContextManager:
        """Within the block, the learner's forward of `model` records what this loss reads; the context's value is
        handed to `learn`."""

    def learn(self, model, tapped, batch, temperature: float, what: str) -> dict[str, float]:
        """One step on the batch (`batch`: a generation.packing.Packed), from what `tap` recorded; its metrics."""

    def shipped(self) -> dict[str, torch.Tensor] | None:
        """The weights this loss adds to every published weight version (None: nothing)."""

    def receive(self, weights: dict[str, torch.Tensor]) -> None:
        """Take back the weights `shipped` gave (a restored checkpoint)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def target(model):
    """What the losses tap and read of `model`: its `aux_target` where it names one, else the model itself."""
    stand_in = getattr(model, "aux_target", None)
    return model if stand_in is None else stand_in


@contextlib.contextmanager
def tapped(model, losses: list[AuxLoss]):
    """Every loss's tap around one forward; yields what each recorded, in the losses' order."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(loss.tap(target(model))) for loss in losses]


def learn(model, losses: list[AuxLoss], taps: list, batch, temperature: float, what: str) -> dict[str, float]:
    """Each loss's step on what it tapped; their metrics, merged (a loss prefixes its own keys)."""
    metrics: dict[str, float] = {}
    for loss, t in zip(losses, taps):
        metrics.update(loss.learn(target(model), t, batch, temperature, what))
    return metrics


def padded(features: torch.Tensor, batch) -> torch.Tensor:
    """Tapped per-token features -> the padded [B * T, ...] layout of `batch` (a generation.packing.Packed), zero
    rows at padding. A forward of the built-in Decoder has one row per row of the batch's Packing (valid tokens, a
    shared prefix once: each sequence then reads the shared rows); one of the padded batch (the Megatron learner's)
    has B * T and is returned as it is."""
    b, length = batch.input_ids.shape
    if features.shape[0] == b * length:
        return features
    packing = Packing.of(batch.input_ids, batch.lengths)
    if features.shape[0] != packing.rows.numel():
        raise ValueError(f"tapped features have {features.shape[0]} rows, but the batch's forward runs "
                         f"{packing.rows.numel()} ({b * length} padded): tap the learner's forward of this batch")
    return packing.unpack(features)
