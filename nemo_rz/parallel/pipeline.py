"""A tap channel: features of chosen layers carried from the ranks that compute them to the rank that reads them,
beside a pipeline schedule rather than inside it.

A draft trained beside the policy reads the outputs of chosen ("aux") layers and of the final norm; under
pipeline parallelism those live on several stages (and under data parallelism each micro-batch on its own
replica). Forward hooks on those modules hand each micro-batch's outputs (detached: the draft does not train the
policy) to the channel the moment they are computed; a point owned by another rank than the consumer is sent
at once (isend) on a process group of the channel's own, so the schedule's messages never wait for the features,
nor the features for the schedule. The consumer takes a micro-batch's point when it needs it.

The pipeline schedule itself is Megatron's (runtime/megatron/schedule.py drives it for the Megatron learner,
which taps through this channel: runtime/megatron/taps.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TapChannel"]


class TapChannel:
    """Carries `points` (n = 0..len(points)-1: what the consumer reads, in that order) of every micro-batch from
    the rank computing it, owner(micro_batch, n), to rank `consumer` of `group` (None: one process)."""

    def __init__(self, points, owner: Callable[[int, int], int], consumer: int, rank: int, group=None):
        self.points, self.owner, self.consumer, self.rank, self.group = tuple(points), owner, consumer, rank, group
        self._kept: dict = {}
        self._sending: list = []

    def _tag(self, micro_batch: int, index: int) -> int:
        return micro_batch * len(self.points) + index

    def put(self, micro_batch: int, index: int, x: torch.Tensor) -> None:
        """Point `index` of `micro_batch`, computed here: kept (the consumer) or sent to the consumer."""
        x = x.detach()
        if self.rank == self.consumer:
            self._kept[micro_batch, index] = x
        else:
            x = x.contiguous()
            self._sending.append((x, dist.isend(x, group=self.group, group_dst=self.consumer,
                                                tag=self._tag(micro_batch, index))))

    def take(self, micro_batch: int, index: int, like: torch.Tensor | None) -> torch.Tensor:
        """On the consumer: point `index` of `micro_batch` (`like`: a tensor of its shape and dtype; None for a
        point computed here)."""
        x = self._kept.pop((micro_batch, index), None)
        if x is None:
            x = torch.empty_like(like)
            dist.irecv(x, group=self.group, group_src=self.owner(micro_batch, index), tag=self._tag(micro_batch, index)).wait()
        return x

    @contextlib.contextmanager
    def tapping(self, modules: Mapping[int, nn.Module], micro_batch: Callable[[], int],
                view: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
        """Within the block, the modules of the points this rank computes ({n: module}) hand their outputs
        (the first element of a tuple output) to the channel, as `view` lays them out, under the micro-batch
        `micro_batch()` says is running."""

        def hook(index):
            def keep(_module, _args, out):
                self.put(micro_batch(), index, view(out[0] if isinstance(out, tuple) else out))
            return keep

        handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def flush(self) -> None:
        """Wait until every point this rank sent has been delivered."""
        for _, work in self._sending:
            work.wait()
        self._sending.clear()
