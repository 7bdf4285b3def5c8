"""Rollout generation: the built-in engine (and, as an extra, a vLLM backend in nemo_rz.generation.vllm)."""
from nemo_rz.generation.engine import PlainPolicy, RolloutEngine, StepPolicy
from nemo_rz.generation.sampling import Completion, SamplingParams

__all__ = ["Completion", "PlainPolicy", "RolloutEngine", "SamplingParams", "StepPolicy"]
