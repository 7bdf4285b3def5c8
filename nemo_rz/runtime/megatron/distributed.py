"""Process groups for the Megatron learner: torch.distributed over gloo, Megatron's
tensor/data-parallel groups, and the two work-arounds megatron-core 0.16 needs to run on CPU.

The learner runs on the CPU, as the trainer around it does (NCCL would need the model on CUDA devices: not yet).
The rendezvous is a FileStore in a private directory, and gloo is told to use the loopback interface, so
nothing listens on a network interface (the launcher, launch.py, sets the environment for its ranks).
"""
from __future__ import annotations

import datetime
import functools
import operator
import os
import tempfile

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.utils import GlobalMemoryBuffer

from nemo_rz.runtime.megatron.layout import Layout

ENV_STORE = "NEMO_RZ_DIST_STORE"  # the rendezvous file a launcher gives its ranks
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}
_GROUPS: tuple | None = None  # (tp, pp, cp, ep) Megatron's groups were built for


# Axes the Megatron learner does not drive yet: refused here, in one line, rather than trained wrongly.
NOT_YET = {
    "pp": "pipeline parallelism is not supported by the Megatron learner yet",
    "ep": "expert parallelism is not supported by the Megatron learner yet",
}


def init(layout: Layout, seed: int = 0) -> None:
    """torch.distributed (a single process starts a world of one) and Megatron's groups for `layout`."""
    for axis, why in NOT_YET.items():
        if getattr(layout, axis) != 1:
            raise ValueError(f"megatron.{axis} = {getattr(layout, axis)}: {why}; use megatron.{axis}=1")
    if not dist.is_initialized():
        for k, v in LOOPBACK_ENV.items():
            os.environ.setdefault(k, v)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        store_path = os.environ.get(ENV_STORE) or os.path.join(tempfile.mkdtemp(prefix="nemo_rz_dist_"), "store")
        store = dist.FileStore(store_path, world)
        # Ranks wait for rank 0 between calls (rollouts, evaluation) for as long as it takes; a rank that dies is
        # noticed by the launcher, not by a timeout.
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(days=1))
    world, (tp, pp, cp, ep) = dist.get_world_size(), (layout.tp, layout.pp, layout.cp, layout.ep)
    if layout.world != world:
        raise ValueError(f"megatron.tp x pp x cp x dp = {tp} x {pp} x {cp} x {layout.dp} = {layout.world}, but the job "
                         f"has {world} process(es); launch with the train CLI, which starts tp x pp x cp x dp processes")
    global _GROUPS
    if parallel_state.model_parallel_is_initialized():
        if _GROUPS == (tp, pp, cp, ep):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep)
    _GROUPS = (tp, pp, cp, ep)
    if not torch.cuda.is_available():
        parallel_state._GLOBAL_MEMORY_BUFFER = CPUMemoryBuffer()
    # The inference tracker keeps its RNG states on the CPU generator (the default one needs CUDA); dropout is
    # off in the learner, so no random number is drawn from it.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)


class CPUMemoryBuffer(GlobalMemoryBuffer):
    """Megatron's scratch buffer (attention scores), allocated on the CPU instead of the current CUDA device."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        needed = functools.reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < needed:
            buf = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
        return buf[:needed].view(tensor_shape)


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def dp_group():
    return parallel_state.get_data_parallel_group()
