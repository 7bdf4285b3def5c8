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

Under context parallelism (megatron.cp > 1) the features stay where they were computed: every context-parallel
rank of tensor-parallel rank 0 (the consumers) keeps its own tokens' rows (context.ContextParallel.local_rows),
and holds a copy of the auxiliary losses (sent from rank 0 when they are registered, `_set_taps` in learner.py)
with a TapView of its own, whose `context_group` tells the losses that the features are the rank's tokens of
the batch's packed row split over that group (a draft then trains over the ranks: DraftTrainer.context_step).
A consumer without the mirror reads the embedding and LM head from a `Lent` copy of them, which follows every
update of the policy.
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


class Lent:
    """The parts of the target an auxiliary loss reads besides its taps (config, embedding, LM head), for a
    context-parallel rank without rank 0's mirror Decoder: a copy of the mirror's, loaded from the policy's whole
    weights after every update (`follow`), as the mirror is."""

    def __init__(self, mirror):
        self.config = mirror.config
        self.model = types.SimpleNamespace(embed_tokens=torch.nn.Embedding.from_pretrained(
            mirror.model.embed_tokens.weight.detach().clone()))
        head = mirror.lm_head
        self.lm_head = None if head is None else types.SimpleNamespace(weight=head.weight.detach().clone())

    @torch.no_grad()
    def follow(self, weights: dict[str, torch.Tensor]) -> None:
        """Load the embedding and LM head from whole Hugging Face-named weights (MegatronPolicy.state_dict)."""
        self.model.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
        if self.lm_head is not None:
            self.lm_head.weight.copy_(weights["lm_head.weight"])


class TapView:
    """What an auxiliary loss taps and reads of the Megatron model on a consumer (see the module doc).
    context_group: None (the features are the batch's rows), or the context-parallel group whose ranks split the
    batch's packed row (each consumer's features are its own tokens')."""

    def __init__(self, mirror, num_layers: int, context_group=None):
        self.mirror, self.hooks, self.context_group = mirror, {}, context_group
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
    """Every rank's part of tapping `points` of the model (`policy`, this rank's stage) for the consumers, over
    `group`: rank 0, or under context parallelism every context-parallel rank of tensor-parallel rank 0
    (`consumer`: whether this rank is one)."""

    def __init__(self, policy, points, per_rank: int, group):
        self.points, self.policy, self.per_rank = tuple(points), policy, per_rank
        cfg = policy.config
        per_stage = cfg.num_layers // policy.pp_size
        self.context = policy.context
        rank, tp_rank = dist.get_rank(group), dist.get_rank(policy.tp)
        if self.context is not None:
            dp, shares = parallel_state.get_data_parallel_world_size(), per_rank * parallel_state.get_data_parallel_world_size()
            if dp > 1 or shares > 1:
                raise ValueError(f"an auxiliary loss (draft.mode) under megatron.cp = {dist.get_world_size(self.context.group)} "
                                 "trains over the context-parallel ranks of the batch's one forward, but megatron.dp = "
                                 f"{dp} and megatron.grad_shares = {shares} cut the batch into {shares} forwards; use "
                                 "megatron.dp=1 (grad_shares 1) or draft.mode=off")
            self.consumer = tp_rank == 0  # each keeps its own tokens' features (pp = dp = 1 here)
            self.channel = TapChannel(self.points, lambda _mb, _n: rank, rank, rank, group)
        else:
            mine = (tp_rank, policy.pp_rank, parallel_state.get_data_parallel_rank())
            ranks = [None] * dist.get_world_size(group)
            dist.all_gather_object(ranks, mine, group=group)
            where = {r: i for i, r in enumerate(ranks)}
            stage = [min(p // per_stage, policy.pp_size - 1) for p in self.points]  # the final norm: the last stage

            def owner(micro_batch: int, n: int) -> int:
                return where[(0, stage[n], micro_batch // per_rank)]

            self.consumer = rank == CONSUMER
            self.channel = TapChannel(self.points, owner, CONSUMER, rank, group)
        self.modules = {}
        if tp_rank == 0:
            block = policy.gpt.decoder
            for n, p in enumerate(self.points):
                if min(p // per_stage, policy.pp_size - 1) == policy.pp_rank:
                    self.modules[n] = block.final_layernorm if p == cfg.num_layers else block.layers[p - policy.offset]
        self.active = False

    def hooks(self, micro_batch):
        """Within the block, this rank's points hand their outputs to the channel (micro_batch(): the global
        share running)."""
        if not self.active:
            return contextlib.nullcontext()
        view = _decoder_layout if self.context is None else self.context.local_rows
        return self.channel.tapping(self.modules, micro_batch, view)

    def collect(self, shares: int, rows: int, length: int, lengths: torch.Tensor) -> list[torch.Tensor] | None:
        """After the forward of `shares` micro-batches of `rows` rows: on a consumer each point's features (the
        batch's [B * T, hidden], zero rows past each length, B = len(lengths); under context parallelism this rank's
        tokens' [n, hidden]); elsewhere None, once what was sent arrived."""
        if not self.active:
            return None
        if not self.consumer:
            self.channel.flush()
            return None
        if self.context is not None:
            return [self.channel.take(0, n, None) for n in range(len(self.points))]
        cfg = self.policy.config
        b = lengths.shape[0]
        like = torch.empty(rows * length, cfg.hidden_size, dtype=cfg.torch_dtype)
        valid = (torch.arange(length)[None, :] < lengths[:, None]).reshape(-1, 1)
        out = []
        for n in range(len(self.points)):
            x = torch.cat([self.channel.take(mb, n, like) for mb in range(shares)])[: b * length]
            out.append(torch.where(valid, x, torch.zeros((), dtype=x.dtype)))
        return out
