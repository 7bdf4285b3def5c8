"""An EAGLE-3-style draft head that proposes tokens for speculative decoding of a target `Decoder`.

Input at position t: the target's hidden states after a few chosen layers (`aux_layers`: low, middle, high),
concatenated and fused by a linear into one hidden vector, together with the embedding of the next token
t + 1 (the target's embedding table, not trained here). One or more decoder layers of the target's own kind
(the `Block` of nemo_rz.models.decoder) turn that into the draft's hidden state g_t, and the target's LM head
reads it to predict token t + 2, over the draft's own vocabulary: the rows of the head for `vocab_size` of the
target's tokens (EAGLE-3's reduced draft vocabulary), the most frequent ones in the first data the draft trains
on. A proposal then costs a [hidden, vocab_size] product instead of the whole head, the largest single cost of a
small draft; tokens outside the draft vocabulary are never proposed (the target still emits them). To propose
further tokens the draft feeds g_t back in place of the target features (the target has not seen its guesses
yet): step s of a branch rooted at t sits at position t + s - 1 and attends to the draft's own entries at
positions <= t (made from target features) and to its branch's earlier steps.

Training runs all s = 1..steps at once for every root (the "training-time test"), with the same attention
pattern, computed by ops.attention's consistent core (through parallel.context's ring and branch attention, on
one rank for a [B, T] batch); inference runs the same layers against a KV cache. Both are the draft's own
Blocks, so in consistent mode a root's training states are the engine's bits. With the target's final hidden states (the learner's
forward has them) the loss is distillation, the cross-entropy against the target's own distribution over the
draft vocabulary: rejection sampling accepts sum_x min(p, q), so q must match p, and a whole distribution per
token teaches that far faster than the one token sampled from it. The draft only proposes: which tokens are kept
and their logprobs are decided by the target (nemo_rz.generation.speculative), so the draft's arithmetic never
reaches a recorded logprob.

Target features come from forward hooks on `model.model.layers[i]` (`aux_features`), and the final hidden
states from one on the final norm: the learner's RL forward and the engine's target passes expose them without
a second forward and without changing the target.
"""
from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nemo_rz import ops
from nemo_rz.models.config import DecoderConfig
from nemo_rz.models.decoder import Decoder, KVCache, Tokens
from nemo_rz.models.layers import Block, Linear, RMSNorm
from nemo_rz.ops import weight_cache


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: a low, a middle and a high layer (1, L/2 - 1, L - 4), clamped to the model."""
    return tuple(sorted({min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)}))


def check_aux_layers(aux_layers, num_layers: int) -> tuple[int, ...]:
    layers = tuple(int(i) for i in aux_layers)
    if not layers:
        raise ValueError("draft.aux_layers is empty: name at least one target layer (or null for the default)")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"draft.aux_layers = {list(layers)}: layer {bad[0]} is outside the target's layers "
                         f"0..{num_layers - 1}; choose indices in that range")
    if len(set(layers)) != len(layers):
        raise ValueError(f"draft.aux_layers = {list(layers)}: a layer is named twice")
    return layers


@contextlib.contextmanager
def aux_features(model: Decoder, layers: tuple[int, ...], final: bool = False):
    """Within the block, every forward of `model` appends its tokens' features [N, len(layers) * hidden]
    (the outputs of those layers, detached) to the yielded list; with `final`, a pair (features, the final
    norm's output [N, hidden], detached)."""
    outs: dict[int, torch.Tensor] = {}
    found: list = []

    def keep(i):
        def hook(_module, _args, out):
            outs[i] = (out[0] if isinstance(out, tuple) else out).detach()
            if len(outs) == len(layers) and not final:
                found.append(torch.cat([outs.pop(j) for j in layers], dim=-1))
        return hook

    def keep_final(_module, _args, out):
        found.append((torch.cat([outs.pop(j) for j in layers], dim=-1), out.detach()))

    handles = [model.model.layers[i].register_forward_hook(keep(i)) for i in layers]
    if final:
        handles.append(model.model.norm.register_forward_hook(keep_final))
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def frequent_tokens(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The `size` most frequent ids of `tokens` (ties: lower id first), filled up with the lowest ids not among
    them (byte-pair vocabularies number their tokens roughly by frequency), sorted ascending."""
    counts = torch.bincount(tokens.reshape(-1).long(), minlength=vocab_size).double()
    rank = counts - torch.arange(vocab_size, dtype=torch.float64) / (2 * vocab_size)  # ties: lower id first
    return torch.sort(torch.topk(rank, size).indices).values


def _draft_config(target: DecoderConfig, num_layers: int) -> DecoderConfig:
    """A plain dense, full-attention layer of the target's width, whatever the target's own layer kinds."""
    t = target
    return DecoderConfig(
        vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_layers=num_layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps, qk_norm=t.qk_norm, max_position_embeddings=t.max_position_embeddings, dtype=t.dtype,
    )


class DraftHead(nn.Module):
    def __init__(self, target: DecoderConfig, aux_layers=None, num_layers: int = 1, vocab_size: int | None = None):
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"draft.num_layers = {num_layers}: must be >= 1")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"draft.vocab_size = {vocab_size}: must be >= 1 (or null for the target's whole vocabulary)")
        self.aux_layers = check_aux_layers(default_aux_layers(target.num_layers) if aux_layers is None else aux_layers,
                                           target.num_layers)
        cfg = self.config = _draft_config(target, num_layers)
        h, dt = cfg.hidden_size, cfg.torch_dtype
        self.fc = Linear(len(self.aux_layers) * h, h, False, dt)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.feature_norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        self.combine = Linear(2 * h, h, False, dt)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dt)
        # The draft's vocabulary: ascending target token ids whose LM-head rows the draft scores (choose_vocab).
        size = cfg.vocab_size if vocab_size is None else min(vocab_size, cfg.vocab_size)
        self.register_buffer("vocab", torch.arange(size), persistent=True)

    kind = "eagle"  # draft.kind

    # -- pieces shared by training and inference -----------------------------------------------------
    def worker_spec(self) -> dict:
        """What a rollout worker builds its copy of this draft from (`from_spec`); the weights come with each version."""
        return dict(kind=self.kind, aux_layers=list(self.aux_layers), num_layers=len(self.layers),
                    vocab_size=self.vocab.numel())

    def spec(self) -> dict:
        """What a saved draft must agree on with the target it serves."""
        c = self.config
        return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, aux_layers=list(self.aux_layers),
                    num_layers=len(self.layers), num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                    draft_vocab_size=self.vocab.numel())

    @property
    def full_vocab(self) -> bool:
        return self.vocab.numel() == self.config.vocab_size

    def choose_vocab(self, tokens: torch.Tensor) -> None:
        """Take the draft vocabulary from data: the most frequent of `tokens` (e.g. a batch's completions)."""
        if not self.full_vocab:
            self.vocab.copy_(frequent_tokens(tokens, self.config.vocab_size, self.vocab.numel()))

    def draft_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each target token's index in the draft vocabulary, -1 where it has none."""
        if self.full_vocab:
            return tokens
        index = torch.searchsorted(self.vocab, tokens)
        hit = self.vocab[index.clamp(max=self.vocab.numel() - 1)] == tokens
        return torch.where(hit, index, torch.full_like(index, -1))

    def check_target(self, target: Decoder) -> None:
        t = target.config
        for name, mine, theirs in (("vocab_size", self.config.vocab_size, t.vocab_size),
                                   ("hidden_size", self.config.hidden_size, t.hidden_size)):
            if mine != theirs:
                raise ValueError(f"draft {name} {mine} does not match the target's {theirs}; "
                                 "use a draft made for this model (or draft.mode=cotrain for a fresh one)")
        check_aux_layers(self.aux_layers, t.num_layers)

    # -- the hooks another draft of this shape overrides (models/mtp.py: DeepSeek-V3's multi-token prediction) --
    @property
    def blocks(self) -> list:
        """The decoder layers one draft step runs, in order."""
        return list(self.layers)

    def tap(self, model: Decoder, final: bool = False):
        """The context in which `model`'s forwards record this draft's target features (`aux_features`)."""
        return aux_features(model, self.aux_layers, final)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        """A step's hidden state from its last layer's output: what the next step reads and `logits` scores."""
        return x

    def _input(self, target: Decoder, feature: torch.Tensor, tokens: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        emb = ops.embedding(tokens, target.model.embed_tokens.weight.detach())
        return self.combine(torch.cat([self.embed_norm(emb), self.feature_norm(feature)], dim=-1))

    def head(self, target: Decoder) -> torch.Tensor:
        """The target LM head's rows of the draft vocabulary [vocab_size, H], detached (the head gets no
        gradient from the draft). Kept on the head (ops.weight_cache) while neither the head nor the vocabulary
        changes: ops.linear keeps its [K, N] copy of a weight on the tensor object, so a fresh tensor per call
        would redo that copy (of the whole head, with the full vocabulary) every draft step."""
        head = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        vocab = self.vocab
        def rows():
            return head.detach() if self.full_vocab else head.detach().index_select(0, vocab)
        return weight_cache.derived(head, "draft.head", rows, weight_cache.key(vocab))

    def logits(self, target: Decoder, g: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab_size] over the draft vocabulary for draft hidden states g [N, H]."""
        return ops.linear(self.norm(g), self.head(target))

    def target_logits(self, target: Decoder, final: torch.Tensor) -> torch.Tensor:
        """The target's own logits over the draft vocabulary, from its final hidden states [N, H]."""
        return ops.linear(final, self.head(target))

    # -- inference -----------------------------------------------------------------------------------
    def new_cache(self, num_seqs: int, max_len: int) -> KVCache:
        c = self.config
        max_len += (-max_len) % ops.KV_BLOCK
        shape = (num_seqs, c.num_kv_heads, max_len, c.head_dim)
        def make():
            return [torch.zeros(shape, dtype=c.torch_dtype) for _ in self.layers]
        return KVCache(make(), make())

    def step(self, target: Decoder, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             seq_idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Draft hidden states [N, H] for N (feature, next token) rows at `positions`, through `cache`.
        feature: fused target features (`self.fc(aux)`) or the draft's own previous hidden state."""
        x = self._input(target, feature, tokens, positions)
        c = self.config
        t = Tokens(tokens, positions, seq_idx, cache)
        t.plan = ops.AttentionPlan(seq_idx, positions, c.num_heads, c.num_kv_heads)
        t.ropes = {c.rope(0): ops.rope_cos_sin(positions, c.head_dim, *c.rope(0))}
        t.cache_rows = cache.rows(t)
        for block in self.blocks:
            x = block(x, t)
        return self._output(x)

    # -- training (all steps of every branch at once) ---------------------------------------------------
    def run_steps(self, target: Decoder, feature: torch.Tensor, reads: list, positions: torch.Tensor, attend):
        """Yield (s, hidden [N, H]) for s = 1..len(reads) over N roots: step s reads token reads[s - 1] [N] at
        position positions + s - 1, step 1 fed by the fused target features `feature` [N, H], each later step by
        the one before. The layers are the draft's own Blocks with their attention handed out (Tokens.attend,
        the seam context parallelism routes a Decoder's attention through): attend(q, keys, values, scale) ->
        [N, heads, D], where keys/values list the layer's k, v [N, Hkv, D] of steps 1..s. Step 1 attends causally
        over the step-1 entries, step s > 1 also, per root, to its own steps 2..s (the pattern the KV cache gives
        at inference): parallel.context's ring and branch attention, over a [B, T] batch on one rank
        (`branches`) or over a shard of a packed row (cp_draft_loss)."""
        c = self.config
        rope = c.rope(0)  # the draft's layers are full-attention layers of one RoPE
        blocks = self.blocks
        keys = [[] for _ in blocks]
        values = [[] for _ in blocks]
        for s, tokens in enumerate(reads, 1):
            at = positions + (s - 1)
            x = self._input(target, feature, tokens, at)
            ropes = {rope: ops.rope_cos_sin(at, c.head_dim, *rope)}
            for block, k, v in zip(blocks, keys, values):
                step = functools.partial(_step_attention, attend, k, v)
                x = block(x, Tokens(tokens, at, None, attend=step, ropes=ropes))  # seq_idx: unused with attend
            x = feature = self._output(x)  # the next step reads this step's hidden state
            yield s, x

    def branches(self, target: Decoder, aux: torch.Tensor, input_ids: torch.Tensor, steps: int):
        """Yield (s, hidden [B, T, H]) for s = 1..steps: step s of the branch rooted at every position t (token
        t + s in, position t + s - 1), step 1 fed by the target features aux [B * T, len(aux_layers) * H]. The
        batch's rows are the sequences of a packed row on one rank: every root's states are the bits
        cp_draft_loss computes for it (the same core as ops.attention, whatever the padding)."""
        from nemo_rz.parallel.context import ZigzagShard, draft_attention  # parallel.context builds on the models

        if steps < 1:
            raise ValueError(f"draft.steps = {steps}: must be >= 1")
        b, length = input_ids.shape
        reads = [F.pad(input_ids[:, s:], (0, s)).reshape(-1) for s in range(1, steps + 1)]  # root t reads t + s (0 past the end)
        positions = torch.arange(length, device=input_ids.device).repeat(b)
        attend = functools.partial(draft_attention, shard=ZigzagShard(range(0, b * length + 1, length), 1, 0), group=None)
        for s, x in self.run_steps(target, self.fc(aux), reads, positions, attend):
            yield s, x.view(b, length, -1)

    def token_losses(self, target: Decoder, g: torch.Tensor, temperature: float, labels: torch.Tensor,
                     final: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row losses [n] of draft states g [n, H] and the draft's log q [n, vocab_size] at `temperature`
        (the engine samples proposals from softmax(logits / temperature): that is the distribution trained). With
        the target's final hidden states `final` [n, H] at the predicted token's position, the cross-entropy
        against the target's distribution at `temperature` over the draft vocabulary; without, against
        `labels` [n] (indices in the draft vocabulary)."""
        logq = torch.log_softmax(self.logits(target, g).float() / temperature, -1)
        if final is None:
            return -logq.gather(1, labels[:, None]).squeeze(1), logq
        with torch.no_grad():
            p = torch.softmax(self.target_logits(target, final).float() / temperature, -1)
        return -(p * logq).sum(-1), logq

    def training_loss(self, target: Decoder, aux: torch.Tensor, input_ids: torch.Tensor, mask: torch.Tensor,
                      steps: int, temperature: float = 1.0, rollout_logprobs: torch.Tensor | None = None,
                      final: torch.Tensor | None = None):
        """Mean over steps of step s's loss on token t + s + 1 (where `mask` [B, T-1] marks it as a trained
        token), the branch fed by its own hidden states: with the target's final hidden states `final`
        [B * T, H], the cross-entropy against the target's distribution at `temperature` over the draft
        vocabulary (distillation); without, against the sampled token (tokens outside the draft vocabulary
        are skipped).

        Returns (loss, per-step metrics). With `rollout_logprobs` [B, T-1] (the target's logprobs of the same
        tokens at `temperature`), each step also reports its estimated acceptance rate under rejection
        sampling, E_{x~p}[min(1, q(x)/p(x))] = sum_x min(p(x), q(x)), with the draft at teacher-forced tokens
        (q(x) = 0 for a token outside the draft vocabulary).
        """
        if steps < 1:
            raise ValueError(f"draft.steps = {steps}: must be >= 1")
        b, length = input_ids.shape
        total, metrics = 0.0, {}
        for s, x in self.branches(target, aux, input_ids, min(steps, length - 2)) if length > 2 else ():
            # Root t predicts token t + s + 1: mask index t + s; the target's distribution for it sits at t + s.
            valid = F.pad(mask[:, s:].bool(), (0, s + 1))
            labels = self.draft_ids(F.pad(input_ids[:, s + 1 :], (0, s + 1)))
            if final is None:
                valid = valid & (labels >= 0)
            rows = valid.reshape(-1).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            labels = labels.reshape(-1).index_select(0, rows)
            losses, logq = self.token_losses(target, x.reshape(b * length, -1).index_select(0, rows), temperature,
                                             labels, None if final is None else final.index_select(0, rows + s))
            loss = losses.mean()
            total = total + loss
            metrics[f"draft_loss_{s}"] = float(loss.detach())
            if rollout_logprobs is not None:
                with torch.no_grad():
                    q = logq.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
                    q = torch.where(labels >= 0, q, torch.full_like(q, -math.inf))
                    p = F.pad(rollout_logprobs[:, s:], (0, s + 1)).reshape(-1).index_select(0, rows)
                    metrics[f"draft_accept_{s}"] = float(torch.exp(torch.clamp(q - p, max=0.0)).mean())
        n = sum(1 for k in metrics if k.startswith("draft_loss_"))
        if n == 0:
            return None, metrics
        return total / n, metrics


def _step_attention(attend, keys: list, values: list, q, k, v, scale):
    """Tokens.attend of one draft layer at one training step: this step's k, v join the layer's earlier steps'."""
    keys.append(k)
    values.append(v)
    return attend(q, keys, values, scale)


def expected_tokens_per_pass(accept: list[float]) -> float:
    """Tokens one verify pass emits on average with per-step acceptance rates accept[0..k-1] (treated as
    independent): 1 + sum_j prod_{s<=j} accept[s]."""
    out, run = 1.0, 1.0
    for a in accept:
        run *= a
        out += run
    return out


def from_spec(target: DecoderConfig, spec: dict) -> DraftHead:
    """A draft of the shape `worker_spec()` described, for a target of config `target` (its weights: random until
    a weight version ships them)."""
    if spec.get("kind", "eagle") == "mtp":
        from nemo_rz.models.mtp import MTPHead  # builds on this module

        return MTPHead(target, spec["num_layers"])
    return DraftHead(target, spec["aux_layers"], spec["num_layers"], spec["vocab_size"])


# -- weights ------------------------------------------------------------------------------------------
def save_draft(draft: DraftHead, path) -> None:
    torch.save({"spec": draft.spec(), "state_dict": draft.state_dict()}, Path(path))


def load_draft(path, target: Decoder) -> DraftHead:
    """A saved draft for `target`; one-line ValueError when the file is missing or does not fit the target."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"draft.checkpoint = {path}: no such file; save one with nemo_rz.models.draft.save_draft")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        spec, state = saved["spec"], saved["state_dict"]
    except Exception as e:  # a torch file of something else, or not a torch file
        raise ValueError(f"draft.checkpoint = {path}: not a saved draft ({type(e).__name__}: {str(e).splitlines()[0][:80]})") from None
    t = target.config
    for name in ("vocab_size", "hidden_size"):
        if spec[name] != getattr(t, name):
            raise ValueError(f"draft.checkpoint = {path}: the draft's {name} {spec[name]} does not match the target's "
                             f"{getattr(t, name)}; use a draft trained for this model")
    draft = DraftHead(t, spec["aux_layers"], spec["num_layers"], spec.get("draft_vocab_size"))
    if draft.spec() != spec:
        raise ValueError(f"draft.checkpoint = {path}: its shape {spec} does not fit the target ({draft.spec()})")
    draft.load_state_dict(state)
    return draft
