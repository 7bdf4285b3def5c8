"""What a rollout request asks for, and what it gets back."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """max_new_tokens: generation budget; temperature: 0 means greedy (logprobs then at temperature 1);
    seed: per-request generator seed (request i of a shared params object uses seed + i);
    stop_token_ids: tokens that end a request (included in its output)."""

    max_new_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens = {self.max_new_tokens!r}: must be an integer >= 1")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"SamplingParams.temperature = {self.temperature!r}: must be finite and >= 0 (0 = greedy)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # float32 [len(token_ids)]: log-softmax(logits / T) at each sampled token
    weight_version: int
    finish_reason: str  # "stop" | "length"
