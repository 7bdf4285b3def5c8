"""The built-in rollout engine: continuous batching over a KV cache, prefix reuse, seeded sampling.

Every step runs one forward over a mix of prompt chunks (prefill) and last tokens (decode) of the running
requests. Queued requests take a slot as soon as one frees, while the others keep decoding. The logprob
recorded for a sampled token comes from `nemo_rz.ops.log_softmax`, the same arithmetic the learner's
`Decoder.token_logprobs` uses, so in consistent mode the two are bitwise equal.
"""
from __future__ import annotations

import collections
import dataclasses

import torch

from nemo_rz import ops
from nemo_rz.generation.prefix_cache import PrefixCache
from nemo_rz.generation.sampling import Completion, SamplingParams
from nemo_rz.models.decoder import Decoder

_SEED_STRIDE = 1_000_003  # spreads unseeded requests' seeds apart


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    slot: int = -1
    computed: int = 0  # tokens whose keys/values are in the cache
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    prompt_stored: bool = False

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


class RolloutEngine:
    """Generate completions with token logprobs from a `Decoder`.

    max_batch_size: concurrent requests (KV-cache slots); max_model_len: prompt + completion limit;
    prefill_chunk: split long prompts into chunks of this many tokens (None: whole prompt in one step);
    prefix_cache_blocks: blocks of 16 tokens kept for prefix reuse (0 disables it).
    """

    def __init__(
        self,
        model: Decoder,
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        prefill_chunk: int | None = None,
        prefix_cache_blocks: int = 4096,
        seed: int = 0,
        weight_version: int = 0,
    ):
        if max_batch_size < 1:
            raise ValueError(f"RolloutEngine: max_batch_size = {max_batch_size}: must be >= 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"RolloutEngine: prefill_chunk = {prefill_chunk}: must be >= 1 or None")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or min(model.config.max_position_embeddings, 1024)
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(max_blocks=prefix_cache_blocks) if prefix_cache_blocks else None
        self.weight_version = weight_version
        self.seed = seed
        self._requests_seen = 0
        self._cache = None
        self.stats = collections.Counter()

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights between generate calls; cached prefixes of the old weights are dropped."""
        self.model.load_state_dict(state_dict, strict=True)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.weight_version = int(version)

    # -- generation --------------------------------------------------------------------------------
    def _requests(self, prompts, params) -> list[_Request]:
        shared = isinstance(params, SamplingParams)
        if not shared and len(params) != len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} SamplingParams; pass one or one per prompt")
        vocab = self.model.config.vocab_size
        reqs = []
        for i, prompt in enumerate(prompts):
            p = params if shared else params[i]
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"generate: prompt {i} is empty; give at least one token (e.g. BOS)")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"generate: prompt {i} has token id {bad[0]} outside the model's vocabulary [0, {vocab})")
            if len(prompt) + p.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"generate: prompt {i} ({len(prompt)} tokens) + max_new_tokens {p.max_new_tokens} exceeds "
                    f"max_model_len {self.max_model_len}; shorten it or raise max_model_len"
                )
            if p.seed is not None:
                seed = p.seed + (i if shared else 0)
            else:
                seed = self.seed * _SEED_STRIDE + self._requests_seen
            self._requests_seen += 1
            reqs.append(_Request(i, prompt, p, torch.Generator().manual_seed(seed)))
        return reqs

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], progress=None) -> list[Completion]:
        waiting = collections.deque(self._requests(prompts, params))
        if self._cache is None or self._cache.max_len < self.max_model_len:
            self._cache = self.model.new_cache(self.max_batch_size, self.max_model_len)
        free = list(range(self.max_batch_size - 1, -1, -1))
        running: list[_Request] = []
        done: dict[int, Completion] = {}
        while waiting or running:
            while waiting and free:
                req = waiting.popleft()
                req.slot = free.pop()
                if self.prefix_cache is not None:
                    req.computed = self.prefix_cache.load(req.prompt, len(req.prompt) - 1, self._cache, req.slot)
                    self.stats["prefix_hit_tokens"] += req.computed
                running.append(req)
            for req in self._step(running):
                running.remove(req)
                free.append(req.slot)
                done[req.index] = Completion(
                    req.prompt, req.tokens, torch.stack(req.logprobs), self.weight_version,
                    "stop" if req.tokens[-1] in req.params.stop_token_ids else "length",
                )
                if progress is not None:
                    progress(1)
        return [done[i] for i in range(len(done))]

    def _step(self, running: list[_Request]) -> list[_Request]:
        """One forward over all running requests; returns those that finished."""
        ids, pos, seq, sample_rows, sampling = [], [], [], [], []
        for req in running:
            seq_tokens = req.sequence
            todo = len(seq_tokens) - req.computed
            if self.prefill_chunk is not None:
                todo = min(todo, self.prefill_chunk)
            ids += seq_tokens[req.computed : req.computed + todo]
            pos += range(req.computed, req.computed + todo)
            seq += [req.slot] * todo
            req.computed += todo
            self.stats["prefill_tokens" if req.tokens == [] else "decode_tokens"] += todo
            if req.computed == len(seq_tokens):
                sample_rows.append(len(ids) - 1)
                sampling.append(req)
        self.stats["steps"] += 1
        model = self.model
        hidden = model.step(torch.tensor(ids), torch.tensor(pos), torch.tensor(seq), self._cache)
        if not sampling:
            return []
        temps = torch.tensor([r.params.temperature or 1.0 for r in sampling], dtype=torch.float32)
        logp = ops.log_softmax(model.logits(hidden[sample_rows]), temps)
        finished = []
        for row, req in enumerate(sampling):
            if req.params.temperature == 0:
                token = int(torch.argmax(logp[row]))
            else:
                token = int(torch.multinomial(logp[row].exp(), 1, generator=req.generator))
            if self.prefix_cache is not None and not req.prompt_stored:
                self.prefix_cache.store(req.prompt, self._cache, req.slot)
                req.prompt_stored = True
            req.tokens.append(token)
            req.logprobs.append(logp[row, token])
            if token in req.params.stop_token_ids or len(req.tokens) >= req.params.max_new_tokens:
                finished.append(req)
        return finished
