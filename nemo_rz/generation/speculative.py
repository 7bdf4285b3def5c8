"""Speculative decoding in the built-in engine: a draft proposes k tokens, one target pass checks them all.

A step for a decoding request runs the target over k + 1 query tokens (the last emitted token and the k draft
tokens) in the same batched forward as every other running request's prompt chunk or decode token, through
the same KV cache and the same consistent ops. Each of those rows is a target row like any other: its bits
do not depend on how many rows came with it, so the logprob recorded for an emitted token is the one a plain
decode step, and the learner's `token_logprobs`, compute for it.

Rejection sampling (Leviathan et al., 2023) keeps the target's distribution: draft token d, sampled from the
draft's q, is kept with probability min(1, p(d) / q(d)); at the first refusal the token is drawn from
max(0, p - q) renormalised, and when all k are kept one more is drawn from p. A draft with a reduced
vocabulary has q = 0 outside it, which the same rule handles. Greedy requests keep a draft
token iff it is the target's argmax, so they emit exactly the tokens of plain greedy decoding. A request's
uniforms are drawn from its own seeded generator on admission, one set per output position (the draft's
sample and the bonus token use the engine's usual uniform for that position), so its tokens depend on its
seed, the weights and k, not on the batch it shares.

Cache entries of refused tokens stay in the slot past the request's length; attention reads a position only
after the request has written it again, so they never reach a later step. The draft keeps its own KV cache
(and prefix cache, keyed by (token, next token) pairs, since its entry at t also depends on token t + 1).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from nemo_rz import ops
from nemo_rz.generation.prefix_cache import PrefixCache
from nemo_rz.models.draft import DraftHead, aux_features


@dataclasses.dataclass
class _State:
    fed: int  # positions 0..fed-1 hold target-feature entries in the draft's cache
    accept_u: list[float]  # per output position: the acceptance test's uniform
    residual_u: list[float]  # per output position: the uniform for a token drawn after a refusal
    pending: list = dataclasses.field(default_factory=list)  # target features of positions fed.. not yet fed
    prompt_stored: bool = False


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=probs.shape[0] - 1))


class Speculator:
    """Draft-and-verify steps for a RolloutEngine (engine.speculator); k: draft tokens proposed per step."""

    def __init__(self, draft: DraftHead, k: int, prefix_cache_blocks: int = 4096):
        if k < 1:
            raise ValueError(f"draft.k = {k}: must be >= 1 (tokens proposed per step)")
        self.draft, self.k = draft.eval(), k
        self.prefix_cache = PrefixCache(max_blocks=prefix_cache_blocks) if prefix_cache_blocks else None
        self._cache = None
        self._state: dict[int, _State] = {}

    # -- engine life cycle ---------------------------------------------------------------------------
    def prepare(self, slots: int, max_len: int) -> None:
        if self._cache is None or self._cache.k[0].shape[0] < slots or self._cache.max_len < max_len:
            self._cache = self.draft.new_cache(slots, max_len)

    def load(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.draft.load_state_dict(state_dict, strict=True)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    @staticmethod
    def _pairs(prompt: list[int]) -> list[tuple[int, int]]:
        return list(zip(prompt[:-1], prompt[1:]))

    def admit(self, engine, req) -> None:
        """A new request: its uniforms, and the draft's prefix hit (the target recomputes past the shorter one)."""
        n = req.params.max_new_tokens
        accept_u = residual_u = []
        if req.params.temperature != 0:
            accept_u = torch.rand(n, generator=req.generator, dtype=torch.float64).tolist()
            residual_u = torch.rand(n, generator=req.generator, dtype=torch.float64).tolist()
        fed = 0
        if self.prefix_cache is not None and req.computed:
            fed = self.prefix_cache.load(self._pairs(req.prompt), req.computed, self._cache, req.slot)
            engine.stats["prefix_hit_tokens"] -= req.computed - fed
            req.computed = fed
        self._state[id(req)] = _State(fed, accept_u, residual_u)

    def release(self, req, clear: bool) -> None:
        self._state.pop(id(req), None)
        if clear:
            for k, v in zip(self._cache.k, self._cache.v):
                k[req.slot].zero_()
                v[req.slot].zero_()

    # -- one step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, engine, running) -> list:
        model = engine.model
        ready = [r for r in running if r.tokens and r.computed == len(r.prompt) + len(r.tokens) - 1]
        start = time.perf_counter()
        proposals = self._propose(model, ready)
        drafted = time.perf_counter()
        engine.stats["spec_draft_s"] += drafted - start  # the draft's share of generation time
        ids: list[int] = []
        pos: list[int] = []
        seq: list[int] = []
        spans = []  # (request, first row, rows)
        n_prefill = 0
        for req in running:
            start = req.computed
            if id(req) in proposals:
                query = [req.sequence[-1]] + proposals[id(req)][0]
            else:
                query = engine._span(req)
                if not req.tokens:
                    n_prefill += len(query)
                req.computed += len(query)
            spans.append((req, len(ids), len(query)))
            ids += query
            pos += range(start, start + len(query))
            seq += [req.slot] * len(query)
        stats = engine.stats
        stats["prefill_tokens"] += n_prefill
        stats["decode_tokens"] += len(ids) - n_prefill
        stats["steps"] += 1
        batch = torch.from_numpy(np.array(ids + pos + seq, dtype=np.int64)).view(3, -1)
        with aux_features(model, self.draft.aux_layers) as found:
            hidden = model.step(batch[0], batch[1], batch[2], engine._cache)
        aux = found[0]

        # Target rows to score: every row of a verified request, the last row of a request whose prompt is done.
        rows, row_temps, scored = [], [], []
        for req, first, n in spans:
            if id(req) in proposals:
                take = list(range(first, first + n))
            elif req.computed == len(req.sequence):
                take = [first + n - 1]
            else:
                take = []
            if take:
                scored.append((req, len(rows), len(take)))
                rows += take
                row_temps += [req.params.temperature or 1.0] * len(take)
        finished = []
        if rows:
            temps = set(row_temps)
            temperature = row_temps[0] if len(temps) == 1 else torch.tensor(row_temps, dtype=torch.float32)
            logp = ops.log_softmax(model.logits(hidden.index_select(0, torch.tensor(rows))), temperature)
            for req, first, n in scored:
                lp = logp[first : first + n]
                if id(req) in proposals:
                    done = self._verify(engine, req, lp, *proposals[id(req)])
                else:
                    done = self._sample_one(engine, req, lp)
                if done:
                    finished.append(req)
        for req, first, n in spans:  # target features of the positions whose cache entries are now valid
            valid = req.computed - pos[first]
            if req not in finished:
                self._state[id(req)].pending.append(aux[first : first + valid])
        engine.stats["spec_step_s"] += time.perf_counter() - start
        return finished

    def _sample_one(self, engine, req, lp: torch.Tensor) -> bool:
        """A plain sample from the request's last row (its first token, or its last when no room is left to draft)."""
        if engine.prefix_cache is not None and not req.prompt_stored:
            engine.prefix_cache.store(req.prompt, engine._cache, req.slot)
            req.prompt_stored = True
        token = int(engine._sample(lp, [req], [req.params.temperature])[0])
        return self._emit(req, token, float(lp[0, token]))

    @staticmethod
    def _emit(req, token: int, logprob: float) -> bool:
        """Append a token; True when the request is finished."""
        req.tokens.append(token)
        req.logprobs.append(logprob)
        return token in req.params.stop_token_ids or len(req.tokens) >= req.params.max_new_tokens

    def _verify(self, engine, req, lp: torch.Tensor, drafts: list[int], q: torch.Tensor, index: list[int]) -> bool:
        """Keep a prefix of `drafts` by rejection sampling against the target's rows `lp` [k + 1, V]; q [k, Vd]:
        the draft distributions over its vocabulary the drafts came from, index: each draft's place in it."""
        state, greedy = self._state[id(req)], req.params.temperature == 0
        p = None if greedy else ops.probabilities(lp)
        kept = 0
        engine.stats["spec_verify"] += 1
        engine.stats["spec_proposed"] += len(drafts)
        for i, d in enumerate(drafts):
            j = len(req.tokens)
            ok = d == int(lp[i].argmax()) if greedy else state.accept_u[j] * float(q[i, index[i]]) < float(p[i, d])
            if not ok:
                if greedy:
                    token = int(lp[i].argmax())
                else:
                    q_full = q[i].double()
                    if not self.draft.full_vocab:  # the draft's q is 0 outside its vocabulary
                        q_full = torch.zeros(p.shape[1], dtype=torch.float64).index_copy_(0, self.draft.vocab, q_full)
                    token = _inverse_cdf(torch.clamp(p[i].double() - q_full, min=0.0), state.residual_u[j])
                req.computed += 1 + kept
                engine.stats["spec_accepted"] += kept
                return self._emit(req, token, float(lp[i, token]))
            kept += 1
            if self._emit(req, d, float(lp[i, d])):
                req.computed += 1 + kept
                engine.stats["spec_accepted"] += kept
                return True
        req.computed += 1 + kept
        engine.stats["spec_accepted"] += kept
        j = len(req.tokens)
        token = int(lp[-1].argmax()) if greedy else _inverse_cdf(p[-1], req.uniforms[j])
        return self._emit(req, token, float(lp[-1, token]))

    # -- the draft's side ----------------------------------------------------------------------------
    def _propose(self, model, ready) -> dict[int, tuple[list[int], torch.Tensor, list[int]]]:
        """Draft tokens, the draft distributions they came from and their indices in the draft vocabulary, for
        each ready request: first the draft catches up on the positions the target has checked since its last
        step."""
        draft, cache = self.draft, self._cache
        budget = {id(r): min(self.k, r.params.max_new_tokens - len(r.tokens) - 1) for r in ready}
        ready = [r for r in ready if budget[id(r)] > 0]
        if not ready:
            return {}
        aux, toks, pos, seq, last = [], [], [], [], []
        for req in ready:
            state, sequence = self._state[id(req)], req.sequence
            aux += state.pending
            toks += sequence[state.fed + 1 : req.computed + 1]
            pos += range(state.fed, req.computed)
            seq += [req.slot] * (req.computed - state.fed)
            last.append(len(toks) - 1)
            state.fed, state.pending = req.computed, []
        t = lambda x: torch.tensor(x, dtype=torch.long)
        g = draft.step(model, draft.fc(torch.cat(aux)), t(toks), t(pos), t(seq), cache)
        g = g.index_select(0, t(last))
        for req in ready:
            state = self._state[id(req)]
            if self.prefix_cache is not None and not state.prompt_stored:
                self.prefix_cache.store(self._pairs(req.prompt), cache, req.slot)
                state.prompt_stored = True

        out = {id(r): ([], [], []) for r in ready}  # draft tokens, their distributions, their draft-vocabulary index
        active, vocab = ready, draft.vocab.tolist()
        for s in range(max(budget[id(r)] for r in ready)):
            temps = torch.tensor([r.params.temperature or 1.0 for r in active], dtype=torch.float32)[:, None]
            logits = draft.logits(model, g).float()
            q = torch.softmax(logits / temps, dim=-1)
            tokens = []
            for i, req in enumerate(active):
                j = len(req.tokens) + s
                x = int(logits[i].argmax()) if req.params.temperature == 0 else _inverse_cdf(q[i], req.uniforms[j])
                tokens.append(vocab[x])
                for part, value in zip(out[id(req)], (vocab[x], q[i], x)):
                    part.append(value)
            keep = [i for i, r in enumerate(active) if budget[id(r)] > s + 1]
            if not keep:
                break
            active = [active[i] for i in keep]
            g = draft.step(model, g[keep], t([tokens[i] for i in keep]), t([r.computed + s for r in active]),
                           t([r.slot for r in active]), cache)
        return {key: (d, torch.stack(q), x) for key, (d, q, x) in out.items()}
