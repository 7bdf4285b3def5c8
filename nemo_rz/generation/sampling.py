"""What a rollout request asks for, what it gets back, its state while the engine runs it, and the sampler."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from nemo_rz import ops


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
    # int16 [len(token_ids), MoE layers * k]: the experts each MoE layer chose (in layer order) for the input
    # token whose output scored each sampled token; None for dense models or engines that do not record it.
    routing: torch.Tensor | None = None


@dataclasses.dataclass
class Request:
    """A request while the engine runs it. Until its prompt is in the cache it is prefilling (no tokens yet);
    from its first token on it is decoding, and before every step all of `sequence` but the last token has its
    keys/values in the cache (`computed == len(sequence) - 1`)."""

    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    slot: int = -1  # its row of the KV cache
    computed: int = 0  # tokens whose keys/values are in the cache
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # float32 values, exact as Python floats
    prompt_stored: bool = False  # its prompt's blocks are in the prefix cache
    uniforms: list[float] | None = None  # one draw from `generator` per token to sample, drawn on admission
    routing: list[torch.Tensor] = dataclasses.field(default_factory=list)  # MoE models: experts per sampled token
    policy_state: Any = None  # what the engine's step policy keeps for this request (a speculator: its draft's)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


def sample(logp: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One token per row of logp [M, V], row i for requests[i]'s next output position: inverse-CDF sampling with
    the request's pre-drawn uniform for that position (argmax for greedy requests). Row by row the same
    arithmetic, so a request's tokens do not depend on the batch it runs in."""
    rows, vocab = logp.shape
    greedy = [i for i, r in enumerate(requests) if r.params.temperature == 0]
    if len(greedy) == rows:
        return logp.argmax(1)
    # Row-invariant probabilities, then a per-row sequential float64 prefix sum.
    cdf = torch.cumsum(ops.probabilities(logp), 1, dtype=torch.float64)
    u = torch.from_numpy(np.array([0.0 if r.params.temperature == 0 else r.uniforms[len(r.tokens)] for r in requests]))
    x = (u * cdf[:, -1]).unsqueeze(1)  # < the row's total mass
    tokens = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=vocab - 1)
    if greedy:
        idx = torch.tensor(greedy)
        tokens[idx] = logp[idx].argmax(1)
    return tokens


SEED_STRIDE = 1_000_003  # spreads unseeded requests' seeds apart: engine seed * stride + request count


def checked_requests(prompts, params, vocab_size: int, max_model_len: int, engine_seed: int, requests_seen: int):
    """Validate a generate() call (one clear error per problem); return a list of (prompt, params, seed), one per request.

    Request i of a shared SamplingParams with seed s uses seed s + i; an unseeded request gets a seed from
    the engine's seed and how many requests the engine has seen, so runs repeat.
    """
    shared = not isinstance(params, (list, tuple))
    if not shared and len(params) != len(prompts):
        raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} SamplingParams; pass one or one per prompt")
    for p in [params] if shared else params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"generate: params must be nemo_rz.generation.SamplingParams, not {type(p).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        p = params if shared else params[i]
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"generate: prompt {i} is empty; give at least one token (e.g. BOS)")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"generate: prompt {i} has token id {bad[0]} outside the model's vocabulary [0, {vocab_size})")
        if len(prompt) + p.max_new_tokens > max_model_len:
            raise ValueError(
                f"generate: prompt {i} ({len(prompt)} tokens) + max_new_tokens {p.max_new_tokens} exceeds "
                f"max_model_len {max_model_len}; shorten it or raise max_model_len"
            )
        if p.seed is not None:
            seed = p.seed + (i if shared else 0)
        else:
            seed = engine_seed * SEED_STRIDE + requests_seen + i
        out.append((prompt, p, seed))
    return out
