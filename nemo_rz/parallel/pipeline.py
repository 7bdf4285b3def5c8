"""Pipeline parallelism for a Decoder, and a tap channel that carries features between stages beside it.

`Pipeline`: rank s of the pipeline's process group runs layers [s * L / S, (s + 1) * L / S) of the model; the
first stage also embeds, the last also normalises and scores. One training step is GPipe: every micro-batch
forward through the stages (activations sent to the next stage), then every micro-batch backward in reverse
(activation gradients sent back). Each stage runs exactly the ops one process would run, in the same shapes,
so losses and gradients equal a one-process run over the same micro-batches bit for bit.

`TapChannel`: a draft trained beside the policy reads the outputs of chosen ("aux") layers, which live on
several stages. Forward hooks on those layers send each micro-batch's outputs (detached: the draft does not
train the policy) to the stage that holds the draft the moment they are computed, on a process group of the
channel's own: the schedule's messages never wait for them, nor they for the schedule. The consumer collects
a micro-batch's features in layer order when it needs them.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from nemo_rz.models.decoder import Decoder, Tokens

__all__ = ["Pipeline", "TapChannel", "embedded", "stage_layers"]

_ACTIVATION_TAG, _GRADIENT_TAG = 21, 22


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The layers stage `stage` of `stages` runs: [stage * L / S, (stage + 1) * L / S)."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"{stages} pipeline stages for {num_layers} layers: need 1 <= stages <= layers")
    return range(stage * num_layers // stages, (stage + 1) * num_layers // stages)


class _Capture(nn.Module):
    def forward(self, x, t):
        self.seen = (x, t)
        return x


def embedded(model: Decoder, input_ids: torch.Tensor) -> tuple[torch.Tensor, Tokens]:
    """(x, t) for a dense batch [B, T]: the embedded tokens [B * T, hidden] and the Tokens the model's layers
    take, both prepared by the model's own forward (its layers swapped for a capture for the call)."""
    b, length = input_ids.shape
    dev = input_ids.device
    t = Tokens(input_ids.reshape(-1), torch.arange(length, device=dev).repeat(b),
               torch.arange(b, device=dev).repeat_interleave(length), None, (b, length))
    layers, capture = model.model.layers, _Capture()
    model.model.layers = nn.ModuleList([capture])
    try:
        model.hidden(t)
    finally:
        model.model.layers = layers
    return capture.seen


class TapChannel:
    """Carries the outputs of `layers` (in that order: the consumer concatenates them) from the stages that
    compute them to stage `consumer`, over `group` (a process group of its own; None: one process)."""

    def __init__(self, layers, num_layers: int, stages: int, consumer: int, group=None):
        self.layers, self.consumer, self.group = tuple(int(i) for i in layers), consumer, group
        bad = [i for i in self.layers if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"tap layers {list(self.layers)}: layer {bad[0]} is outside 0..{num_layers - 1}")
        self.owner = [next(s for s in range(stages) if i in stage_layers(num_layers, stages, s)) for i in self.layers]
        self._kept: dict = {}
        self._sending: list = []

    def _tag(self, micro_batch: int, index: int) -> int:
        return micro_batch * len(self.layers) + index

    @contextlib.contextmanager
    def tapping(self, model: Decoder, stage: int, micro_batch: int):
        """Within the block, this stage's tapped layers hand their outputs of `micro_batch` to the channel."""

        def hook(index):
            def keep(_module, _args, out):
                x = (out[0] if isinstance(out, tuple) else out).detach()
                if stage == self.consumer:
                    self._kept[micro_batch, index] = x
                else:
                    x = x.contiguous()
                    self._sending.append((x, dist.isend(x, group=self.group, group_dst=self.consumer, tag=self._tag(micro_batch, index))))
            return keep

        handles = [model.model.layers[i].register_forward_hook(hook(n))
                   for n, (i, owner) in enumerate(zip(self.layers, self.owner)) if owner == stage]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def features(self, micro_batch: int, like: torch.Tensor) -> torch.Tensor:
        """On the consumer: the tapped features of `micro_batch` [N, len(layers) * hidden] (`like`: an
        [N, hidden] tensor of the batch's shape and dtype)."""
        parts = []
        for n, owner in enumerate(self.owner):
            x = self._kept.pop((micro_batch, n), None)
            if x is None:
                x = torch.empty_like(like)
                dist.irecv(x, group=self.group, group_src=owner, tag=self._tag(micro_batch, n)).wait()
            parts.append(x)
        return torch.cat(parts, dim=-1)

    def flush(self) -> None:
        """Wait until every feature this stage sent has been delivered."""
        for _, work in self._sending:
            work.wait()
        self._sending.clear()


class Pipeline:
    """GPipe training steps of `model` split over the ranks of `group` (None: one process, one stage)."""

    def __init__(self, model: Decoder, group=None, tap: TapChannel | None = None):
        self.model, self.group, self.tap = model, group, tap
        self.stages = 1 if group is None else dist.get_world_size(group)
        self.stage = 0 if group is None else dist.get_rank(group)
        self.layers = stage_layers(model.config.num_layers, self.stages, self.stage)
        self.last = self.stage == self.stages - 1

    def step(self, input_ids: torch.Tensor, micro_batches: int,
             loss: Callable[[Decoder, torch.Tensor, torch.Tensor], torch.Tensor],
             draft_loss: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> dict:
        """Forward and backward of `input_ids` [B, T] in `micro_batches` equal chunks: parameter gradients
        accumulate as for the sum over micro-batches of loss(model, final hidden [b * T, hidden], ids) / micro_batches.
        On the tap channel's consumer, draft_loss(micro_batch, features, ids) is differentiated at once (its
        inputs are detached, so it trains only the draft). Returns the losses this stage computed (floats)."""
        if input_ids.shape[0] % micro_batches:
            raise ValueError(f"batch of {input_ids.shape[0]} rows in {micro_batches} micro-batches: the batch must divide evenly")
        chunks = input_ids.chunk(micro_batches)
        kept, out = [], {"loss": 0.0, "draft_loss": 0.0}
        for mb, ids in enumerate(chunks):
            x0, t = embedded(self.model, ids)
            x = x0 if self.stage == 0 else self._recv(x0, self.stage - 1, _ACTIVATION_TAG).requires_grad_()
            tapping = self.tap.tapping(self.model, self.stage, mb) if self.tap else contextlib.nullcontext()
            with tapping:
                y = x
                for i in self.layers:
                    y = self.model.model.layers[i](y, t)
            if self.last:
                y = loss(self.model, self.model.model.norm(y), ids) / micro_batches
                out["loss"] += float(y.detach())
            else:
                dist.send(y.detach().contiguous(), group=self.group, group_dst=self.stage + 1, tag=_ACTIVATION_TAG)
            kept.append((x, y))
            if self.tap is not None and self.tap.consumer == self.stage:
                features = self.tap.features(mb, x0.detach())  # received even when unused: senders wait for it
                if draft_loss is not None:
                    d = draft_loss(mb, features, ids)
                    d.backward()
                    out["draft_loss"] += float(d.detach())
        for x, y in reversed(kept):
            if self.last:
                y.backward()
            else:
                y.backward(self._recv(y.detach(), self.stage + 1, _GRADIENT_TAG))
            if self.stage > 0:
                dist.send(x.grad.contiguous(), group=self.group, group_dst=self.stage - 1, tag=_GRADIENT_TAG)
        if self.tap is not None:
            self.tap.flush()
        return out

    def _recv(self, like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        x = torch.empty_like(like)
        dist.recv(x, group=self.group, group_src=src, tag=tag)
        return x
