"""The built-in rollout engine: continuous batching over a KV cache, prefix reuse, seeded sampling.

Every step runs one forward over a mix of prompt chunks (prefill) and query tokens (decode) of the running
requests: schedule -> forward -> score -> emit. Queued requests take a slot as soon as one frees, while the
others keep decoding. The logprob recorded for an emitted token comes from `nemo_rz.ops.log_softmax`, the
same arithmetic the learner's `Decoder.token_logprobs` uses, so in consistent mode the two are bitwise equal.

What a decoding request feeds in a step and what it emits is the step policy's (`StepPolicy`): `PlainPolicy`
feeds its last token and samples one token from that row; a speculative policy
(nemo_rz.generation.speculative.SpeculativePolicy) also feeds a draft's proposals and keeps the prefix of them the
target's rows accept. Either way every scored row is a target row like any other, computed in the same batched
forward, and the loop around them is this one.

Requests with the same prompt admitted together (a GRPO group) compute it once: the others wait one step in
their slots, then start from a copy of its keys/values (all but the last prompt token's, which each computes to
score its own first token), as from a prefix-cache hit of every token; their bits are what computing the prompt
themselves would give.

Sampling is inverse-CDF over the full distribution, all rows at once, with one uniform per token drawn from
the request's own seeded generator when the request is admitted: a request's tokens depend on its seed, not
on the batch it runs in.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
from typing import Protocol

import numpy as np
import torch

from nemo_rz import ops
from nemo_rz.generation.prefix_cache import PrefixCache
from nemo_rz.generation.sampling import Completion, Request, SamplingParams, checked_requests, sample
from nemo_rz.models import lora
from nemo_rz.models.decoder import Decoder
from nemo_rz.models.moe import recorded_routing


def _longs(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))  # (several times faster than torch.tensor)


@dataclasses.dataclass
class Query:
    """One running request's share of a step: `tokens` (at its next positions) in rows first.. of the forward,
    and its rows of the step's logprobs (`scored`): every row of a decoding request's query, the last row of a
    prompt's final chunk, none for an earlier chunk."""

    request: Request
    tokens: list[int]
    first: int
    scored: range


class StepPolicy(Protocol):
    """What each decoding request feeds a step and emits from it. The engine calls, once: bind; per weight
    version: load_weights; when it allocates its cache: prepare; per request: admit ... release; per step:
    query_tokens before the forward, observe around it, consume after it (with the scored rows' logprobs)."""

    max_query_tokens: int  # the most tokens query_tokens gives a request (sizes sliding-window rings)

    def bind(self, model: Decoder, stats: collections.Counter) -> None:
        """The target the engine runs and the engine's counters (one engine per policy)."""

    def load_weights(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        """Load this policy's own weights from the parts that travel with the target's (a draft's, by name)."""

    def prepare(self, slots: int, max_len: int) -> None:
        """Per-slot state for `slots` requests of up to `max_len` tokens."""

    def admit(self, req: Request, cached: int) -> int:
        """A new request whose first `cached` prompt tokens are in the cache (prefix hit); returns how many of
        them to keep (the engine computes the rest of the prompt)."""

    def query_tokens(self, decoding: list[Request]) -> list[list[int]]:
        """The tokens each decoding request feeds this step: its last token, then any proposals."""

    def observe(self, model: Decoder) -> contextlib.AbstractContextManager:
        """A context around the step's target forward."""

    def consume(self, queries: list[Query], logp: torch.Tensor | None) -> list[list[int]]:
        """The tokens each query emits, from its scored rows of logp [scored rows, V] (None: no row scored).
        n tokens come from rows 0..n-1, and the first n - 1 are the query's own tokens 1..n-1 (accepted
        proposals): their cache entries stay, those of the rest of the query are dropped."""

    def release(self, req: Request, clear: bool) -> None:
        """A finished request; `clear`: its slot held non-finite values."""


class PlainPolicy:
    """Plain decoding: a decoding request feeds its last token and samples the next from that row."""

    max_query_tokens = 1

    def bind(self, model, stats) -> None:
        pass

    def load_weights(self, parts):
        pass

    def prepare(self, slots, max_len) -> None:
        pass

    def admit(self, req, cached):
        return cached

    def query_tokens(self, decoding):
        return [[req.tokens[-1]] for req in decoding]

    def observe(self, model):
        return contextlib.nullcontext()

    def consume(self, queries, logp):
        if logp is None:
            return [[] for _ in queries]
        scored = [q.request for q in queries if q.scored]
        tokens = sample(logp, scored).tolist()
        if len(scored) == len(queries):
            return [[t] for t in tokens]
        it = iter(tokens)
        return [[next(it)] if q.scored else [] for q in queries]

    def release(self, req, clear) -> None:
        pass


class RolloutEngine:
    """Generate completions with token logprobs from a `Decoder`.

    max_batch_size: concurrent requests (KV-cache slots); max_model_len: prompt + completion limit;
    prefill_chunk: split long prompts into chunks of this many tokens (None: whole prompt in one step);
    prefix_cache_blocks: blocks of 16 tokens kept for prefix reuse (0 disables it);
    policy: the step policy (`StepPolicy`; default `PlainPolicy`); speculator: a speculative policy
    (`nemo_rz.generation.speculative.Speculator`, draft-and-verify steps), the same as passing it as `policy`.
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
        policy: StepPolicy | None = None,
    ):
        if max_batch_size < 1:
            raise ValueError(f"RolloutEngine: max_batch_size = {max_batch_size}: must be >= 1")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"RolloutEngine: prefill_chunk = {prefill_chunk}: must be >= 1 or None")
        if policy is not None and speculator is not None:
            raise ValueError("RolloutEngine: pass a speculator or a policy, not both (a speculator is a policy)")
        # A linear-attention model's state (models/linear_attention.py) holds no per-position entries to copy or
        # roll back: no prefix-cache hits, no twin forks, no speculative rejections (its requests compute their prompts).
        # DeepSeek-V4's compressors' state (models/deepseek_v4.py) is not copied by prefix hits or twin forks yet:
        # its requests compute their prompts too.
        self._carried = model.config.has_linear_attention or model.config.attention_kind == "deepseek_v4"
        if self._carried and (policy is not None and not isinstance(policy, PlainPolicy) or speculator is not None):
            raise ValueError("RolloutEngine: speculative decoding is not supported for linear-attention models or "
                             "DeepSeek-V4 (a rejected proposal cannot be taken out of the recurrent or compressed "
                             "state); use plain decoding")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len or min(model.config.max_position_embeddings, 1024)
        self.prefill_chunk = prefill_chunk
        self.prefix_cache = PrefixCache(max_blocks=prefix_cache_blocks) if prefix_cache_blocks and not self._carried else None
        self.weight_version = weight_version
        self.seed = seed
        self._requests_seen = 0
        self._cache = None
        self.stats = collections.Counter()
        self.policy = policy or speculator or PlainPolicy()
        self.policy.bind(model, self.stats)

    @property
    def speculator(self):
        """The speculative policy, or None for plain steps."""
        return None if isinstance(self.policy, PlainPolicy) else self.policy

    # -- weights -----------------------------------------------------------------------------------
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int,
                       parts: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Load new weights between generate calls; cached prefixes of the old weights are dropped. The step
        policy takes its own from `parts` (runtime.weights.WeightsBundle.parts: a speculator, the draft's). A model
        with LoRA adapters (models/lora.py) takes a whole state dict or its adapters' tensors alone."""
        lora.load_weights(self.model, state_dict)  # whole, or a LoRA model's adapters alone (swapped in place)
        self.policy.load_weights(parts or {})
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.weight_version = int(version)

    # -- generation --------------------------------------------------------------------------------
    def _requests(self, prompts, params) -> list[Request]:
        checked = checked_requests(prompts, params, self.model.config.vocab_size, self.max_model_len, self.seed, self._requests_seen)
        self._requests_seen += len(checked)
        return [Request(i, prompt, p, torch.Generator().manual_seed(seed)) for i, (prompt, p, seed) in enumerate(checked)]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], progress=None) -> list[Completion]:
        waiting = collections.deque(self._requests(prompts, params))
        policy = self.policy
        if self._cache is None or self._cache.max_len < self.max_model_len:
            self._cache = self.model.new_cache(self.max_batch_size, self.max_model_len, step_tokens=self._step_tokens())
            policy.prepare(self.max_batch_size, self._cache.max_len)
        free = list(range(self.max_batch_size - 1, -1, -1))
        running: list[Request] = []
        done: dict[int, Completion] = {}
        prefilling: dict[tuple[int, ...], Request] = {}  # a prompt -> the request computing it this wave
        forks: dict[int, list[Request]] = collections.defaultdict(list)  # id(that request) -> same-prompt requests
        while waiting or running:
            while waiting and free:
                req = waiting.popleft()
                req.slot = free.pop()
                first = prefilling.get(tuple(req.prompt))
                if first is not None and first.computed < len(first.prompt) and not self._carried:  # its twin computes it
                    forks[id(first)].append(req)
                    continue
                self._admit(req, self._prefix_hit(req), running)
                prefilling[tuple(req.prompt)] = req
            finished = self._step(running)
            for req in list(running):
                if forks and req.computed >= len(req.prompt) and id(req) in forks:
                    for twin in forks.pop(id(req)):  # its prompt's keys/values, minus the last (each row samples)
                        self._copy_slot(req.slot, twin.slot)
                        self._admit(twin, len(twin.prompt) - 1, running)
            for req in finished:
                running.remove(req)
                free.append(req.slot)
                finite = all(math.isfinite(x) for x in req.logprobs)
                if not finite:
                    self._clear_slot(req.slot)  # non-finite keys/values must not leak to the slot's next request
                policy.release(req, clear=not finite)
                done[req.index] = Completion(
                    req.prompt, req.tokens, torch.tensor(req.logprobs, dtype=torch.float32), self.weight_version,
                    "stop" if req.tokens[-1] in req.params.stop_token_ids else "length",
                    torch.stack(req.routing) if len(req.routing) == len(req.tokens) else None,
                )
                if progress is not None:
                    progress(1)
        return [done[i] for i in range(len(done))]

    def _prefix_hit(self, req: Request) -> int:
        """Prompt tokens of `req` the prefix cache copies into its slot (whole blocks of an earlier request's)."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.load(req.prompt, len(req.prompt) - 1, self._cache, req.slot)

    def _admit(self, req: Request, cached: int, running: list[Request]) -> None:
        """Start `req` in its slot with its first `cached` prompt tokens' keys/values already there (the policy
        keeps what it can use of them)."""
        if req.params.temperature != 0:
            req.uniforms = torch.rand(req.params.max_new_tokens, generator=req.generator, dtype=torch.float64).tolist()
        req.computed = self.policy.admit(req, cached)
        self.stats["prefix_hit_tokens"] += req.computed
        running.append(req)

    def _copy_slot(self, src: int, dst: int) -> None:
        """Slot `dst` gets every layer's keys/values of slot `src`: a request whose twin (the same prompt, admitted
        with it) has just computed the prompt starts from its bits, as from a prefix-cache hit of every token."""
        for k, v in zip(self._cache.k, self._cache.v):
            k[dst].copy_(k[src])
            if v is not k:
                v[dst].copy_(v[src])

    def _step_tokens(self) -> int | None:
        """The most tokens one step computes for a request (None: a whole prompt), which sizes sliding-window
        layers' caches: a prefill chunk, or the policy's longest query."""
        if self.prefill_chunk is None:
            return None
        return max(self.prefill_chunk, self.policy.max_query_tokens)

    def _clear_slot(self, slot: int) -> None:
        for k, v in zip(self._cache.k, self._cache.v):
            k[slot].zero_()
            v[slot].zero_()

    def _prompt_chunk(self, req: Request) -> list[int]:
        """The prompt tokens this step computes for a prefilling request: the rest, or the next chunk."""
        end = len(req.prompt) if self.prefill_chunk is None else min(len(req.prompt), req.computed + self.prefill_chunk)
        return req.prompt[req.computed : end]

    def _step(self, running: list[Request]) -> list[Request]:
        """One forward over all running requests: schedule -> forward -> score -> emit. Returns the requests
        that finished."""
        policy, model = self.policy, self.model
        queries, batch, rows, temps = self._schedule(running)
        routed = recorded_routing(model) if model.config.num_experts else contextlib.nullcontext({})
        with routed as routing, policy.observe(model):
            hidden = model.step(batch[0], batch[1], batch[2], self._cache)
        logp = self._score(hidden, rows, temps) if rows else None
        emitted = policy.consume(queries, logp)
        # MoE models: the experts each MoE layer chose for the scored rows
        experts = torch.cat([log[0] for log in routing.values()], 1)[rows].to(torch.int16) if routing else None
        return self._emit(queries, emitted, logp, experts)

    def _schedule(self, running: list[Request]) -> tuple[list[Query], torch.Tensor, list[int], list[float]]:
        """Each request's query (a decoding request feeds what the policy gives it, a prefilling one its next
        prompt chunk); the batch [3, N] of token ids, positions and cache slots; the rows to score and their
        temperatures (greedy: 1)."""
        decode_queries = iter(self.policy.query_tokens([req for req in running if req.tokens]))
        queries: list[Query] = []
        ids: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        rows: list[int] = []
        temps: list[float] = []
        n_prefill = 0
        for req in running:
            start, first = req.computed, len(ids)
            if req.tokens:
                tokens = next(decode_queries)
                n = len(tokens)
                scored = n  # every row: the last token's and each proposal's
            else:
                tokens = self._prompt_chunk(req)
                n = len(tokens)
                n_prefill += n
                scored = int(start + n == len(req.prompt))  # the last row of the prompt's final chunk
            queries.append(Query(req, tokens, first, range(len(rows), len(rows) + scored)))
            rows += range(first + n - scored, first + n)
            temps += [req.params.temperature or 1.0] * scored
            ids += tokens
            pos += range(start, start + n)
            seq += [req.slot] * n
            req.computed = start + n
        self.stats["prefill_tokens"] += n_prefill
        self.stats["decode_tokens"] += len(ids) - n_prefill
        self.stats["steps"] += 1
        return queries, _longs(ids + pos + seq).view(3, -1), rows, temps

    def _score(self, hidden: torch.Tensor, rows: list[int], temps: list[float]) -> torch.Tensor:
        """Logprobs [len(rows), V] of the scored rows of the forward's `hidden`, each at its temperature."""
        if len(rows) < hidden.shape[0]:
            hidden = hidden.index_select(0, _longs(rows))
        temperature = temps[0] if len(set(temps)) == 1 else torch.tensor(temps, dtype=torch.float32)
        return ops.log_softmax(self.model.logits(hidden), temperature)

    def _emit(self, queries: list[Query], emitted: list[list[int]], logp: torch.Tensor | None,
              experts: torch.Tensor | None) -> list[Request]:
        """Append each query's emitted tokens with their logprobs (token i from its scored row i) and, for MoE
        models, their rows' experts; returns the requests that finished."""
        vocab = 0 if logp is None else logp.shape[1]
        at = [(q.scored.start + i) * vocab + t for q, tokens in zip(queries, emitted) for i, t in enumerate(tokens)]
        if not at:
            return []
        chosen = torch.take(logp, _longs(at)).tolist()
        finished, n = [], 0
        for q, tokens in zip(queries, emitted):
            if not tokens:
                continue
            req = q.request
            if self.prefix_cache is not None and not req.prompt_stored:
                self.prefix_cache.store(req.prompt, self._cache, req.slot)
                req.prompt_stored = True
            if experts is not None:
                req.routing += experts[q.scored.start : q.scored.start + len(tokens)]
            params = req.params
            for i, token in enumerate(tokens, n):  # up to the first that finishes it
                req.tokens.append(token)
                req.logprobs.append(chosen[i])
                if token in params.stop_token_ids or len(req.tokens) >= params.max_new_tokens:
                    finished.append(req)
                    break
            n += len(tokens)
            # The last token is fed next step; the cache entries of the query's refused proposals are dropped.
            req.computed = len(req.prompt) + len(req.tokens) - 1
        return finished
