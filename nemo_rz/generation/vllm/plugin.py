"""`vllm.general_plugins` entry point (setup.py): vLLM calls `register()` in every one of its processes
(front end, engine core, workers, the model-inspection subprocess). It must stay cheap and idempotent, and it
imports vllm only inside the function, so installing nemo-rz never makes importing it depend on vllm."""
from __future__ import annotations

from nemo_rz.generation.vllm import ARCH

MODEL_CLASS = "nemo_rz.generation.vllm.model:NemoRZForCausalLM"


def register() -> None:
    """Make architecture "NemoRZForCausalLM" resolve to nemo-rz's Decoder running inside vLLM (lazily: the
    model module is imported only in processes that build the model)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, MODEL_CLASS)
