"""Process groups for the Megatron learner: torch.distributed over gloo, Megatron's
tensor/data-parallel groups, and the two work-arounds megatron-core 0.16 needs to run on CPU.

The learner runs on the CPU by default, as the trainer around it does (megatron.device=cpu: gloo). With
megatron.device=cuda each rank computes on cuda:LOCAL_RANK with NCCL for CUDA tensors and gloo for the CPU ones
(the learner's messages, the batch), one backend per tensor's device ("cpu:gloo,cuda:nccl"); `placement` says
which a rank's environment gives, and `device()` is the one place the Megatron policy (model.py) takes its device
from: its parameters and every batch go there. The rendezvous is a FileStore in a private directory, and gloo and NCCL are
told to use the loopback interface, so nothing listens on a network interface (the launcher, launch.py, sets the
environment for its ranks).

Each rank a launcher started beats a heartbeat to it from `init` on (nemo_rz.runtime.heartbeat; the train CLI's
ranks from their start, launch.lead / follow): a rank silent for megatron.heartbeat_s seconds is stopped or stuck,
and the launcher stops the job.
"""
from __future__ import annotations

import dataclasses
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

from nemo_rz.runtime import heartbeat
from nemo_rz.runtime.megatron.layout import Layout

ENV_STORE = "NEMO_RZ_DIST_STORE"  # the rendezvous file a launcher gives its ranks
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
_GROUPS: tuple | None = None  # (tp, pp, cp, ep) Megatron's groups were built for


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a rank computes: its torch.distributed backend and its device."""
    backend: str
    device: torch.device


CPU = Placement("gloo", torch.device("cpu"))
_PLACEMENT = CPU  # this process's, set by init


def placement(device: str, env=None, cuda_devices: int | None = None) -> Placement:
    """The placement `device` (megatron.device) gives this rank. cpu: gloo on the CPU. cuda: cuda:LOCAL_RANK
    (torchrun's variable; else RANK: the launcher starts every rank on one machine), NCCL for CUDA tensors and
    gloo for CPU ones; refused in one line where this process sees no CUDA device, or fewer than its local rank
    needs. `env` (os.environ) and `cuda_devices` (torch.cuda's count, 0 without CUDA) are for tests."""
    if device == "cpu":
        return CPU
    if device != "cuda":
        raise ValueError(f"megatron.device = {device!r}: expected cpu or cuda")
    env = os.environ if env is None else env
    if cuda_devices is None:
        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(env.get("LOCAL_RANK", env.get("RANK", 0)))
    if cuda_devices == 0:
        raise ValueError("megatron.device = cuda: this process sees no CUDA device (torch.cuda.is_available() is "
                         "False); use megatron.device=cpu")
    if local >= cuda_devices:
        raise ValueError(f"megatron.device = cuda: local rank {local} needs cuda:{local}, but this process sees "
                         f"{cuda_devices} CUDA device(s); start at most {cuda_devices} ranks per machine, or use megatron.device=cpu")
    return Placement("cpu:gloo,cuda:nccl", torch.device("cuda", local))


def device() -> torch.device:
    """This rank's device (init's placement): where the Megatron policy keeps its weights and runs its batches."""
    return _PLACEMENT.device


# Axes the Megatron learner does not drive yet: refused here, in one line, rather than trained wrongly.
NOT_YET: dict[str, str] = {}


def init(layout: Layout, seed: int = 0) -> None:
    """torch.distributed (a single process starts a world of one) and Megatron's groups for `layout`."""
    heartbeat.beat()
    for axis, why in NOT_YET.items():
        if getattr(layout, axis) != 1:
            raise ValueError(f"megatron.{axis} = {getattr(layout, axis)}: {why}; use megatron.{axis}=1")
    global _GROUPS, _PLACEMENT
    where = placement(layout.device)
    if dist.is_initialized() and where != _PLACEMENT:
        raise ValueError(f"megatron.device = {layout.device}: this process already computes on {_PLACEMENT.device}; "
                         "one device per process")
    if not dist.is_initialized():
        if where.device.type == "cuda":
            torch.cuda.set_device(where.device)
        for k, v in LOOPBACK_ENV.items():
            os.environ.setdefault(k, v)
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        store_path = os.environ.get(ENV_STORE) or os.path.join(tempfile.mkdtemp(prefix="nemo_rz_dist_"), "store")
        store = dist.FileStore(store_path, world)
        # Ranks wait for rank 0 between calls (rollouts, evaluation) for as long as it takes; a rank that dies is
        # noticed by the launcher, not by a timeout.
        dist.init_process_group(where.backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(days=1))
    world, (tp, pp, cp, ep) = dist.get_world_size(), (layout.tp, layout.pp, layout.cp, layout.ep)
    if layout.world != world:
        raise ValueError(f"megatron.tp x pp x cp x dp = {tp} x {pp} x {cp} x {layout.dp} = {layout.world}, but the job "
                         f"has {world} process(es); launch with the train CLI, which starts tp x pp x cp x dp processes")
    _PLACEMENT = where
    if parallel_state.model_parallel_is_initialized():
        if _GROUPS == (tp, pp, cp, ep):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, expert_model_parallel_size=ep)
    _GROUPS = (tp, pp, cp, ep)
    if where.device.type == "cpu":
        parallel_state._GLOBAL_MEMORY_BUFFER = CPUMemoryBuffer()
        # The inference tracker keeps its RNG states on the CPU generator (the default one needs CUDA); dropout
        # is off in the learner, so no random number is drawn from it.
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    else:
        model_parallel_cuda_manual_seed(seed)


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
