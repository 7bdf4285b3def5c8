"""The auxiliary losses' taps (algorithms/aux_loss.py) on the Megatron model: a co-trained draft reads the
outputs of its aux layers and of the final norm of the learner's own RL forward, as on the built-in learner.

An auxiliary loss hooks a Decoder's tap points (`model.model.layers[i]`, `model.model.norm`). On the Megatron
learner the loss, on rank 0, hooks a `TapView` instead: the same points, whose hooks are called once the
forward is done with the Megatron model's features in the layout the built-in learner's forward gives after
aux_loss.padded ([B * T, hidden], row-major, zero rows at padding), and the mirror Decoder (which holds the
weights the forward ran with) for everything else a loss reads (embedding, LM head, config).

Every rank hooks the Megatron TransformerLayers (and the final norm) of the points it computes: its stage's
layers (pipeline parallelism), its shares of the batch (data parallelism), on tensor-parallel rank 0 only
(the other ranks hold the same activations). Points computed elsewhere than on rank 0 reach it through
parallel.pipeline.TapChannel, on a process group of their own, outside Megatron's schedule.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from nemo_rz.parallel.pipeline import TapChannel

CONSUMER = 0  # the rank that trains the auxiliary losses (the trainer's)


class _Point:
    """One tap point of a TapView: forward hooks registered here get the Megatron model's features."""

    def __init__(self, view: "TapView", index: int):
        self.view, self.index = view, index

    def register_forward_hook(self, hook):
        hooks = self.view.hooks.setdefault(self.index, [])
        hooks.append(hook)
        return types.SimpleNamespace(remove=lambda: hooks.remove(hook))


class TapView:
    """What an auxiliary loss taps and reads of the Megatron model on rank 0 (see the module doc)."""

    def __init__(self, mirror, num_layers: int):
        self.mirror, self.hooks = mirror, {}
        self.model = types.SimpleNamespace(layers=[_Point(self, i) for i in range(num_layers)],
                                           norm=_Point(self, num_layers), embed_tokens=mirror.model.embed_tokens)

    def __getattr__(self, name):  # lm_head, config, ...: the mirror's
        return getattr(self.__dict__["mirror"], name)

    def points_of(self, loss) -> tuple[int, ...]:
        """The points `loss` taps (entered once, on no forward): layer indices, num_layers for the final norm."""
        with loss.tap(self):
            points = tuple(sorted(i for i, hooks in self.hooks.items() if hooks))
        return points

    def deliver(self, points, features) -> None:
        """Call the hooks of `points` (ascending: the final norm last) with their features."""
        for point, x in zip(points, features):
            for hook in list(self.hooks.get(point, ())):
                hook(self.model.norm if point == len(self.model.layers) else self.model.layers[point], (), x)


def _decoder_layout(x: torch.Tensor) -> torch.Tensor:
    """Megatron's [T, B, hidden] -> the Decoder's token order [B * T, hidden]."""
    return x.transpose(0, 1).reshape(-1, x.shape[-1])


class Taps:
    """Every rank's part of tapping `points` of the model (`policy`, this rank's stage) for rank 0, over `group`."""

    def __init__(self, policy, points, per_rank: int, group):
        self.points, self.policy, self.per_rank = tuple(points), policy, per_rank
        cfg = policy.config
        per_stage = cfg.num_layers // policy.pp_size
        mine = (dist.get_rank(policy.tp), policy.pp_rank, parallel_state.get_data_parallel_rank(),
                parallel_state.get_context_parallel_rank())  # cp: the batch's rows gathered on cp rank 0 (context.py)
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, mine, group=group)
        where = {r: i for i, r in enumerate(ranks)}
        stage = [min(p // per_stage, policy.pp_size - 1) for p in self.points]  # the final norm: the last stage

        def owner(micro_batch: int, n: int) -> int:
            return where[(0, stage[n], micro_batch // per_rank, 0)]

        self.channel = TapChannel(self.points, owner, CONSUMER, dist.get_rank(group), group)
        self.modules = {}
        if mine[0] == 0:
            block = policy.gpt.decoder
            for n, p in enumerate(self.points):
                if stage[n] == policy.pp_rank:
                    self.modules[n] = block.final_layernorm if p == cfg.num_layers else block.layers[p - policy.offset]
        self.active = False

    def hooks(self, micro_batch):
        """Within the block, this rank's points hand their outputs to the channel (micro_batch(): the global
        share running)."""
        if not self.active:
            return contextlib.nullcontext()
        cp = self.policy.context
        if cp is None:
            return self.channel.tapping(self.modules, micro_batch, _decoder_layout)
        if parallel_state.get_context_parallel_rank() == 0:
            return self.channel.tapping(self.modules, micro_batch, cp.batch_rows)
        return cp.gathering(self.modules)  # the other context-parallel ranks' part of batch_rows' gather

    def collect(self, shares: int, rows: int, length: int, lengths: torch.Tensor) -> list[torch.Tensor] | None:
        """After the forward of `shares` micro-batches of `rows` rows: on rank 0 each point's features of the batch
        ([B * T, hidden], zero rows past each length; B = len(lengths)); elsewhere None, once what was sent arrived."""
        if not self.active:
            return None
        if self.channel.rank != CONSUMER:
            self.channel.flush()
            return None
        cfg = self.policy.config
        b = lengths.shape[0]
        like = torch.empty(rows * length, cfg.hidden_size, dtype=cfg.torch_dtype)
        valid = (torch.arange(length)[None, :] < lengths[:, None]).reshape(-1, 1)
        out = []
        for n in range(len(self.points)):
            x = torch.cat([self.channel.take(mb, n, like) for mb in range(shares)])[: b * length]
            out.append(torch.where(valid, x, torch.zeros((), dtype=x.dtype)))
        return out
