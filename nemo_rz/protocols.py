"""The three seams where one implementation can stand in for another, as typing.Protocols.

KVCacheProtocol     what a `Decoder` layer writes keys/values into and attention reads from:
                    models.decoder.KVCache (the built-in engine's) and generation.vllm.attention.PagedKVCache
                    (vLLM's paged cache).
RolloutEngineProtocol  what a rollout worker drives: generation.RolloutEngine (built-in) and
                    generation.vllm.VLLMRolloutEngine.
RuntimeBackendProtocol  where the trainer's jobs run: runtime.local.LocalBackend (processes on this machine) and
                    runtime.ray_backend.RayBackend (Ray actors).

This module imports nothing from nemo_rz at run time, so any layer may depend on it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from nemo_rz.generation.sampling import Completion, SamplingParams
    from nemo_rz.runtime.jobs import Job, Result


@runtime_checkable
class KVCacheProtocol(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, t) -> None:
        """Store the keys/values [N, Hkv, D] of the step's N tokens (`t`: the decoder's Tokens) for `layer`."""

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(keys, values, block table or None) of `layer`, as `nemo_rz.ops.attention` reads them."""


@runtime_checkable
class RolloutEngineProtocol(Protocol):
    weight_version: int  # the version every completion of the next generate() call records

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress=None) -> list[Completion]:
        """One completion per prompt, in order, with float32 logprobs of log-softmax(logits / T) at each token."""

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int,
                       parts: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Load new weights between generate() calls and forget state computed with the old ones; `parts` are the
        weights that travel with the policy's (runtime.weights.WeightsBundle.parts: a draft's)."""


@runtime_checkable
class RuntimeBackendProtocol(Protocol):
    @property
    def restarts(self) -> int:
        """Rollout workers restarted so far."""

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Make weight version `version` available to the jobs that name it."""

    def submit(self, job: Job) -> None:
        """Queue a job; it runs with the weight version it names."""

    def poll(self, timeout: float) -> list[Result]:
        """Results finished since the last poll (possibly none after `timeout` seconds)."""

    def close(self) -> None:
        """Stop every worker."""
