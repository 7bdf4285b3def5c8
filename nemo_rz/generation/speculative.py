"""Speculative decoding in the built-in engine: a draft proposes k tokens, one target pass checks them all.

`SpeculativePolicy` (also named `Speculator`) is a step policy of the engine
(nemo_rz.generation.engine.StepPolicy). A decoding request feeds
k + 1 query tokens (its last token and the k draft tokens) in the same batched forward as every other running
request's prompt chunk or decode token, through the same KV cache and the same consistent ops, and the engine
scores all k + 1 rows. Each of those rows is a target row like any other: its bits do not depend on how many
rows came with it, so the logprob recorded for an emitted token is the one a plain decode step, and the
learner's `token_logprobs`, compute for it.

Rejection sampling (Leviathan et al., 2023) keeps the target's distribution: draft token d, sampled from the
draft's q, is kept with probability min(1, p(d) / q(d)); at the first refusal the token is drawn from
max(0, p - q) renormalised, and when all k are kept one more is drawn from p. A draft with a reduced
vocabulary has q = 0 outside it, which the same rule handles. Greedy requests keep a draft
token iff it is the target's argmax, so they emit exactly the tokens of plain greedy decoding. A request's
uniforms are drawn from its own seeded generator on admission, one set per output position (the draft's
sample and the bonus token use the engine's usual uniform for that position), so its tokens depend on its
seed, the weights and k, not on the batch it shares.

The engine keeps the cache entries of the kept tokens; those of refused tokens stay in the slot past the
request's length, and attention reads a position only after the request has written it again, so they never
reach a later step. The draft keeps its own KV cache (and prefix cache, keyed by (token, next token) pairs,
since its entry at t also depends on token t + 1); what it knows of each request lives on the request
(`request.policy_state`, a `DraftState`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

import numpy as np
import torch

from nemo_rz import ops
from nemo_rz.generation.prefix_cache import PrefixCache
from nemo_rz.generation.sampling import sample
from nemo_rz.models.draft import DraftHead


@dataclasses.dataclass
class DraftState:
    """The speculator's state of one request (request.policy_state)."""

    fed: int  # positions 0..fed-1 hold target-feature entries in the draft's cache
    accept_u: list[float]  # per output position: the acceptance test's uniform
    residual_u: list[float]  # per output position: the uniform for a token drawn after a refusal
    pending: list = dataclasses.field(default_factory=list)  # target features of positions fed.. not yet fed
    prompt_stored: bool = False
    # This step's proposal: draft tokens, the draft distributions q [n, Vd] they came from, their draft-vocabulary
    # indices; None when the request has no room to draft.
    proposal: tuple[list[int], torch.Tensor, list[int]] | None = None


def _longs(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))  # (several times faster than torch.tensor)


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_(max=probs.shape[0] - 1))


class SpeculativePolicy:
    """Draft-and-verify steps for a RolloutEngine (`RolloutEngine(model, speculator=SpeculativePolicy(draft, k))`);
    k: draft tokens proposed per step."""

    def __init__(self, draft: DraftHead, k: int, prefix_cache_blocks: int = 4096):
        if k < 1:
            raise ValueError(f"draft.k = {k}: must be >= 1 (tokens proposed per step)")
        self.draft, self.k = draft.eval(), k
        self.max_query_tokens = k + 1
        self.prefix_cache = PrefixCache(max_blocks=prefix_cache_blocks) if prefix_cache_blocks else None
        self.model = None  # the target, and the engine's counters: bind()
        self.stats = None
        self._cache = None
        self._aux = None  # the target features of the step's forward (observe), read by consume
        self._step_start = 0.0

    # -- engine life cycle ---------------------------------------------------------------------------
    def bind(self, model, stats) -> None:
        self.draft.check_target(model)
        self.model, self.stats = model, stats

    def prepare(self, slots: int, max_len: int) -> None:
        if self._cache is None or self._cache.k[0].shape[0] < slots or self._cache.max_len < max_len:
            self._cache = self.draft.new_cache(slots, max_len)

    def load(self, state_dict: dict[str, torch.Tensor]) -> None:
        """The draft's own weights."""
        self.draft.load_state_dict(state_dict, strict=True)
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def load_weights(self, parts: dict[str, dict[str, torch.Tensor]]) -> None:
        """The draft's weights, when this version ships them (a co-trained draft); else the draft stays as it is."""
        if "draft" in parts:
            self.load(parts["draft"])

    @staticmethod
    def _pairs(prompt: list[int]) -> list[tuple[int, int]]:
        return list(zip(prompt[:-1], prompt[1:]))

    def admit(self, req, cached: int) -> int:
        """A new request: its uniforms, and the draft's prefix hit (the target recomputes past the shorter one)."""
        n = req.params.max_new_tokens
        accept_u = residual_u = []
        if req.params.temperature != 0:
            accept_u = torch.rand(n, generator=req.generator, dtype=torch.float64).tolist()
            residual_u = torch.rand(n, generator=req.generator, dtype=torch.float64).tolist()
        fed = 0
        if self.prefix_cache is not None and cached:
            fed = self.prefix_cache.load(self._pairs(req.prompt), cached, self._cache, req.slot)
        req.policy_state = DraftState(fed, accept_u, residual_u)
        return fed

    def release(self, req, clear: bool) -> None:
        req.policy_state = None
        if clear:
            for k, v in zip(self._cache.k, self._cache.v):
                k[req.slot].zero_()
                v[req.slot].zero_()

    # -- one step ------------------------------------------------------------------------------------
    def query_tokens(self, decoding: list) -> list[list[int]]:
        """Each decoding request's last token and the draft's proposals after it (none without room to draft)."""
        self._step_start = time.perf_counter()
        self._propose(decoding)
        self.stats["spec_draft_s"] += time.perf_counter() - self._step_start  # the draft's share of generation time
        out = []
        for req in decoding:
            proposal = req.policy_state.proposal
            out.append([req.tokens[-1]] + (proposal[0] if proposal is not None else []))
        return out

    @contextlib.contextmanager
    def observe(self, model):
        """Keep the target features of the forward: the draft's inputs at the positions it computes."""
        with self.draft.tap(model) as found:
            yield
        self._aux = found[0]

    def consume(self, queries: list, logp: torch.Tensor | None) -> list[list[int]]:
        """A plain sample from each single scored row (a request's first token, or its last when no room was
        left to draft); a verified prefix of the proposals and one more token for each proposing request."""
        out = [[] for _ in queries]
        single = [i for i, q in enumerate(queries) if len(q.scored) == 1]
        if single:
            lp = logp if len(single) == logp.shape[0] else logp[[queries[i].scored.start for i in single]]
            for i, token in zip(single, sample(lp, [queries[i].request for i in single]).tolist()):
                out[i] = [token]
        for i, q in enumerate(queries):
            req = q.request
            state = req.policy_state
            if state.proposal is not None:
                out[i] = self._verify(req, logp[q.scored.start : q.scored.stop], *state.proposal)
                state.proposal = None
            # target features of the positions whose cache entries stay valid: a prompt chunk, or the query up
            # to its last emitted token
            valid = len(out[i]) if req.tokens else len(q.tokens)
            state.pending.append(self._aux[q.first : q.first + valid])
        self._aux = None
        self.stats["spec_step_s"] += time.perf_counter() - self._step_start
        return out

    def _verify(self, req, lp: torch.Tensor, drafts: list[int], q: torch.Tensor, index: list[int]) -> list[int]:
        """Keep a prefix of `drafts` by rejection sampling against the target's rows `lp` [k + 1, V]; q [k, Vd]:
        the draft distributions over its vocabulary the drafts came from, index: each draft's place in it.
        Returns the tokens to emit: the kept drafts, then the token drawn at the first refusal or after the last
        draft (none after a kept stop token)."""
        state, greedy, stats = req.policy_state, req.params.temperature == 0, self.stats
        p = None if greedy else ops.probabilities(lp)
        stats["spec_verify"] += 1
        stats["spec_proposed"] += len(drafts)
        kept: list[int] = []
        for i, d in enumerate(drafts):
            j = len(req.tokens) + i  # the output position
            ok = d == int(lp[i].argmax()) if greedy else state.accept_u[j] * float(q[i, index[i]]) < float(p[i, d])
            if not ok:
                if greedy:
                    token = int(lp[i].argmax())
                else:
                    q_full = q[i].double()
                    if not self.draft.full_vocab:  # the draft's q is 0 outside its vocabulary
                        q_full = torch.zeros(p.shape[1], dtype=torch.float64).index_copy_(0, self.draft.vocab, q_full)
                    token = _inverse_cdf(torch.clamp(p[i].double() - q_full, min=0.0), state.residual_u[j])
                stats["spec_accepted"] += len(kept)
                return kept + [token]
            kept.append(d)
            if d in req.params.stop_token_ids:  # (the budget: drafts always leave room for one more token)
                stats["spec_accepted"] += len(kept)
                return kept
        stats["spec_accepted"] += len(kept)
        j = len(req.tokens) + len(kept)
        token = int(lp[-1].argmax()) if greedy else _inverse_cdf(p[-1], req.uniforms[j])
        return kept + [token]

    # -- the draft's side ----------------------------------------------------------------------------
    def _propose(self, decoding: list) -> None:
        """Each decoding request's proposal (DraftState.proposal) where it has room for one: first the draft
        catches up on the positions the target has checked since its last step, then it drafts up to k tokens."""
        draft, cache, model = self.draft, self._cache, self.model
        budgets = [min(self.k, r.params.max_new_tokens - len(r.tokens) - 1) for r in decoding]
        ready = [r for r, b in zip(decoding, budgets) if b > 0]
        budgets = [b for b in budgets if b > 0]
        if not ready:
            return
        aux, toks, pos, seq, last = [], [], [], [], []
        for req in ready:
            state, sequence = req.policy_state, req.sequence
            aux += state.pending
            toks += sequence[state.fed + 1 : req.computed + 1]
            pos += range(state.fed, req.computed)
            seq += [req.slot] * (req.computed - state.fed)
            last.append(len(toks) - 1)
            state.fed, state.pending = req.computed, []
        g = draft.step(model, draft.fc(torch.cat(aux)), _longs(toks), _longs(pos), _longs(seq), cache)
        g = g.index_select(0, _longs(last))
        for req in ready:
            state = req.policy_state
            if self.prefix_cache is not None and not state.prompt_stored:
                self.prefix_cache.store(self._pairs(req.prompt), cache, req.slot)
                state.prompt_stored = True

        for req in ready:  # draft tokens, their distributions, their draft-vocabulary indices
            req.policy_state.proposal = ([], [], [])
        active, vocab = ready, draft.vocab.tolist()
        for s in range(max(budgets)):
            temps = torch.tensor([r.params.temperature or 1.0 for r in active], dtype=torch.float32)[:, None]
            logits = draft.logits(model, g).float()
            q = torch.softmax(logits / temps, dim=-1)
            tokens = []
            for i, req in enumerate(active):
                j = len(req.tokens) + s
                x = int(logits[i].argmax()) if req.params.temperature == 0 else _inverse_cdf(q[i], req.uniforms[j])
                tokens.append(vocab[x])
                for part, value in zip(req.policy_state.proposal, (vocab[x], q[i], x)):
                    part.append(value)
            keep = [i for i, b in enumerate(budgets) if b > s + 1]
            if not keep:
                break
            active, budgets = [active[i] for i in keep], [budgets[i] for i in keep]
            g = draft.step(model, g[keep], _longs([tokens[i] for i in keep]), _longs([r.computed + s for r in active]),
                           _longs([r.slot for r in active]), cache)
        for req in ready:
            d, q, x = req.policy_state.proposal
            req.policy_state.proposal = (d, torch.stack(q), x)


Speculator = SpeculativePolicy  # the name the engine, the rollout worker and the benchmarks use
