"""The built-in rollout engine: continuous batching over a KV cache, prefix reuse, seeded sampling.

Every step runs one forward over a mix of prompt chunks (prefill) and last tokens (decode) of the running
requests. Queued requests take a slot as soon as one frees, while the others keep decoding. The logprob
recorded for a sampled token comes from `nemo_rz.ops.log_softmax`, the same arithmetic the learner's
`Decoder.token_logprobs` uses, so in consistent mode the two are bitwise equal.

Sampling is inverse-CDF over the full distribution, all rows at once, with one uniform per token drawn from
the request's own seeded generator when the request is admitted: a request's tokens depend on its seed, not
on the batch it runs in.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math

import numpy as np
import torch

from nemo_rz import ops
from nemo_rz.generation.prefix_cache import PrefixCache
from nemo_rz.generation.sampling import Completion, SamplingParams, checked_requests
from nemo_rz.models.decoder import Decoder
from nemo_rz.models.draft import split_state
from nemo_rz.models.moe import recorded_routing



@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    slot: int = -1
    computed: int = 0  # tokens whose keys/values are in the cache
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)  # float32 values, exact as Python floats
    prompt_stored: bool = False
    uniforms: list[float] | None = None  # one draw from `generator` per token to sample, drawn on admission
    routing: list[torch.Tensor] = dataclasses.field(default_factory=list)  # MoE models: experts per sampled token

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


class RolloutEngine:
    """Generate completions with token logprobs from a `Decoder`.

    max_batch_size: concurrent requests (KV-cache slots); max_model_len: prompt + completion limit;
    prefill_chunk: split long prompts into chunks of this many tokens (None: whole prompt in one step);
    prefix_cache_blocks: blocks of 16 tokens kept for prefix reuse (0 disables it);
    speculator: a `nemo_rz.generation.speculative.Speculator` (draft-and-verify steps), or None for plain steps.
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
        speculator=None,
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
        self.speculator = speculator
        if speculator is not None:
            speculator.draft.check_target(model)

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load new weights between generate calls; cached prefixes of the old weights are dropped. With a
        speculator, the draft's weights come in the same dict (keys under `draft.`)."""
        if self.speculator is not None:
            state_dict, draft = split_state(state_dict)
            if draft is not None:
                self.speculator.load(draft)
        self.model.load_state_dict(state_dict, strict=True)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.weight_version = int(version)

    # -- generation --------------------------------------------------------------------------------
    def _requests(self, prompts, params) -> list[_Request]:
        checked = checked_requests(prompts, params, self.model.config.vocab_size, self.max_model_len, self.seed, self._requests_seen)
        self._requests_seen += len(checked)
        return [_Request(i, prompt, p, torch.Generator().manual_seed(seed)) for i, (prompt, p, seed) in enumerate(checked)]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], progress=None) -> list[Completion]:
        waiting = collections.deque(self._requests(prompts, params))
        if self._cache is None or self._cache.max_len < self.max_model_len:
            self._cache = self.model.new_cache(self.max_batch_size, self.max_model_len, step_tokens=self._step_tokens())
        spec = self.speculator
        if spec is not None:
            spec.prepare(self.max_batch_size, self._cache.max_len)
        step = self._step if spec is None else (lambda reqs: spec.step(self, reqs))
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
                if req.params.temperature != 0:
                    req.uniforms = torch.rand(req.params.max_new_tokens, generator=req.generator, dtype=torch.float64).tolist()
                if spec is not None:
                    spec.admit(self, req)
                running.append(req)
            for req in step(running):
                running.remove(req)
                free.append(req.slot)
                finite = all(math.isfinite(x) for x in req.logprobs)
                if not finite:
                    self._clear_slot(req.slot)  # non-finite keys/values must not leak to the slot's next request
                if spec is not None:
                    spec.release(req, clear=not finite)
                done[req.index] = Completion(
                    req.prompt, req.tokens, torch.tensor(req.logprobs, dtype=torch.float32), self.weight_version,
                    "stop" if req.tokens[-1] in req.params.stop_token_ids else "length",
                    torch.stack(req.routing) if len(req.routing) == len(req.tokens) else None,
                )
                if progress is not None:
                    progress(1)
        return [done[i] for i in range(len(done))]

    def _step_tokens(self) -> int | None:
        """The most tokens one step computes for a request (None: a whole prompt), which sizes sliding-window
        layers' caches: a prefill chunk, or a speculative step's k + 1 target positions."""
        if self.prefill_chunk is None:
            return None
        return max(self.prefill_chunk, 1 if self.speculator is None else self.speculator.k + 1)

    def _clear_slot(self, slot: int) -> None:
        for k, v in zip(self._cache.k, self._cache.v):
            k[slot].zero_()
            v[slot].zero_()

    def _span(self, req: _Request) -> list[int]:
        """The tokens this step computes for `req`: the rest of its sequence, or the next prefill chunk."""
        prompt, tokens, start = req.prompt, req.tokens, req.computed
        n_prompt = len(prompt)
        total = n_prompt + len(tokens)
        end = total if self.prefill_chunk is None else min(total, start + self.prefill_chunk)
        if start >= n_prompt:
            return tokens[start - n_prompt : end - n_prompt]
        return prompt[start:end] + (tokens[: end - n_prompt] if end > n_prompt else [])

    def _step(self, running: list[_Request]) -> list[_Request]:
        """One forward over all running requests; returns those that finished."""
        ids: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        sample_rows, sampling = [], []
        n_prefill = 0
        for req in running:
            start = req.computed
            span = self._span(req)
            end = start + len(span)
            ids += span
            pos += range(start, end)
            seq += [req.slot] * (end - start)
            if not req.tokens:
                n_prefill += end - start
            req.computed = end
            if end == len(req.prompt) + len(req.tokens):
                sample_rows.append(len(ids) - 1)
                sampling.append(req)
        stats = self.stats
        stats["prefill_tokens"] += n_prefill
        stats["decode_tokens"] += len(ids) - n_prefill
        stats["steps"] += 1
        model = self.model
        batch = torch.from_numpy(np.array(ids + pos + seq, dtype=np.int64)).view(3, -1)
        with recorded_routing(model) if model.config.num_experts else contextlib.nullcontext({}) as routing:
            hidden = model.step(batch[0], batch[1], batch[2], self._cache)
        if not sampling:
            return []
        if len(sample_rows) < len(ids):
            hidden = hidden.index_select(0, torch.tensor(sample_rows))
        if routing:  # the experts of each MoE layer for the rows that score the sampled tokens
            chosen_experts = torch.cat([log[0] for log in routing.values()], 1)[sample_rows].to(torch.int16)
            for req, experts in zip(sampling, chosen_experts):
                req.routing.append(experts)
        temps = [r.params.temperature for r in sampling]
        if all(t == 0 or t == 1.0 for t in temps):
            temperature = 1.0  # greedy requests record logprobs at temperature 1
        else:
            temperature = torch.tensor([t or 1.0 for t in temps], dtype=torch.float32)
        logp = ops.log_softmax(model.logits(hidden), temperature)
        tokens = self._sample(logp, sampling, temps)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
        finished = []
        for req, token, lp in zip(sampling, tokens.tolist(), chosen):
            if self.prefix_cache is not None and not req.prompt_stored:
                self.prefix_cache.store(req.prompt, self._cache, req.slot)
                req.prompt_stored = True
            req.tokens.append(token)
            req.logprobs.append(lp)
            if token in req.params.stop_token_ids or len(req.tokens) >= req.params.max_new_tokens:
                finished.append(req)
        return finished

    @staticmethod
    def _sample(logp: torch.Tensor, sampling: list[_Request], temps: list[float]) -> torch.Tensor:
        """One token per row of logp [M, V]: inverse-CDF sampling with each request's next pre-drawn uniform
        (argmax for greedy requests). Row by row the same arithmetic, so a request's tokens do not depend on
        the batch it runs in."""
        rows, vocab = logp.shape
        greedy = [i for i, t in enumerate(temps) if t == 0]
        if len(greedy) == rows:
            return logp.argmax(1)
        # Row-invariant probabilities, then a per-row sequential float64 prefix sum.
        cdf = torch.cumsum(ops.probabilities(logp), 1, dtype=torch.float64)
        u = torch.tensor([0.0 if t == 0 else r.uniforms[len(r.tokens)] for r, t in zip(sampling, temps)], dtype=torch.float64)
        x = (u * cdf[:, -1]).unsqueeze(1)  # < the row's total mass
        tokens = torch.searchsorted(cdf, x, right=True).squeeze(1).clamp_(max=vocab - 1)
        if greedy:
            idx = torch.tensor(greedy)
            tokens[idx] = logp[idx].argmax(1)
        return tokens
