"""REINFORCE Zero as a NeMo RL loss function (docs/contracts.md, 6).

NeMo RL has no plugin registry: a loss plugs in by meeting its `LossFunction` protocol (v0.6+) -
attributes `loss_type` and `input_type`, and
    loss_fn(data=..., global_valid_seqs=..., global_valid_toks=..., next_token_logprobs=...) -> (loss, metrics)
NeMo RL runs the loss once per microbatch and sums losses (and metrics) over microbatches, so every
normaliser here is a GLOBAL count; the per-microbatch losses then add up to the full batch's loss.

Data (a dict / BatchedDataDict, token tensors [B, S] aligned with input_ids):
    input_ids, token_mask, generation_logprobs (rollout), prev_logprobs (learner before the step),
    advantages ([B, S] per token or [B]), sample_mask [B]
next_token_logprobs [B, S-1] scores input_ids[:, 1:], so every token tensor is sliced [:, 1:].

With `logprobs_from_logits` (a callable (logits, input_ids) -> [B, S-1], e.g.
nemo_rz.runtime.megatron.nemo_rl_policy.VocabParallelLogprobs) the loss asks NeMo RL for the model's logits
instead (input_type LOGIT: NeMo RL then calls it with `logits=` rather than `next_token_logprobs=`) and computes the
logprobs with that callable: nemo-rz's log-softmax instead of NeMo RL's.

This module never imports nemo_rl. When nemo_rl is already imported (we run inside NeMo RL), the
attributes use NeMo RL's own enums, because NeMo RL compares them with ==; otherwise small enums of
our own with the same values.
"""
from __future__ import annotations

import enum
import importlib
import sys
from collections.abc import Mapping
from typing import Any

import torch

from nemo_rz.algorithms.corrections import correction_params, importance_weights
from nemo_rz.metrics import mismatch_metrics


class LossType(str, enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class LossInputType(str, enum.Enum):
    LOGIT = "logit"
    LOGPROB = "logprob"


class MetricNormalizer(str, enum.Enum):
    TOKENS = "tokens"        # divided by global_valid_toks
    SEQUENCES = "sequences"  # divided by global_valid_seqs
    NONE = "none"            # raw counts, local extremes


def _enums() -> tuple[Any, Any, Any]:
    """NeMo RL's (LossType, LossInputType, MetricNormalizer) if nemo_rl is loaded, else ours."""
    if "nemo_rl" in sys.modules:
        for name in ("nemo_rl.algorithms.loss.interfaces", "nemo_rl.algorithms.interfaces"):
            try:
                m = importlib.import_module(name)
                return m.LossType, m.LossInputType, getattr(m, "MetricNormalizer", MetricNormalizer)
            except (ImportError, AttributeError):
                continue
    return LossType, LossInputType, MetricNormalizer


_TOKEN_METRICS = ("is_dev", "k1", "k3", "gen_kl_error", "token_mult_prob_error", "rejection_rate")
_REQUIRED = ("input_ids", "token_mask", "sample_mask", "generation_logprobs", "prev_logprobs", "advantages")


class ReinforceZeroLossFn:
    """L = -(1/G_seq) sum_i (1/T_i) sum_t w_t A_i lp_t   (sequence level, the default; G_seq = global_valid_seqs)
       L = -(1/G_tok) sum_i sum_t w_t A_i lp_t            (token_level_loss=True; G_tok = global_valid_toks)

    w_t = importance weight of `correction` (default `unclipped`: rho = exp(lp_t - generation_lp_t),
    detached), computed from the current learner logprobs (ratio_source="current") or from NeMo RL's
    `prev_logprobs` (ratio_source="prev"). Valid tokens: token_mask * sample_mask.
    Metrics are shares of the global counts too (their sum over microbatches is the batch value), except
    probs_ratio_min / probs_ratio_max (local extremes; NeMo RL reduces them with min / max) and
    num_valid_samples (a count).
    """

    loss_type = LossType.SEQUENCE_LEVEL
    input_type = LossInputType.LOGPROB

    def __init__(self, correction: str = "unclipped", token_level_loss: bool = False,
                 ratio_source: str = "current", logprobs_from_logits=None, **params):
        self.correction = correction
        self.params = correction_params(correction, params)        # raises on unknown names
        if ratio_source not in ("current", "prev"):
            raise ValueError(f"ReinforceZeroLossFn: unknown ratio_source {ratio_source!r}: use current or prev")
        self.ratio_source = ratio_source
        if logprobs_from_logits is not None and not callable(logprobs_from_logits):
            raise ValueError(f"ReinforceZeroLossFn: logprobs_from_logits = {logprobs_from_logits!r} is not callable; "
                             "pass a function (logits, input_ids) -> [B, S-1] logprobs, or None")
        if logprobs_from_logits is not None and ratio_source != "current":
            raise ValueError("ReinforceZeroLossFn: ratio_source = 'prev' with logprobs_from_logits: NeMo RL computes "
                             "prev_logprobs with its own log-softmax, so the ratio would carry that mismatch; use "
                             "ratio_source=current")
        self.logprobs_from_logits = logprobs_from_logits
        lt, it, mn = _enums()
        self.loss_type = lt.TOKEN_LEVEL if token_level_loss else lt.SEQUENCE_LEVEL
        self.input_type = it.LOGPROB if logprobs_from_logits is None else it.LOGIT
        norm = {k: mn.TOKENS for k in _TOKEN_METRICS}
        norm.update(loss=mn.TOKENS if token_level_loss else mn.SEQUENCES, probs_ratio_min=mn.NONE,
                    probs_ratio_max=mn.NONE, num_valid_samples=mn.NONE)
        self.metric_normalizations = norm
        self._token_level = token_level_loss

    def __call__(self, data: Mapping, global_valid_seqs, global_valid_toks,
                 next_token_logprobs: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, dict]:
        # Later NeMo RL versions also call losses positionally as (next_token_logprobs or logits, data, seqs, toks).
        if isinstance(data, torch.Tensor) and isinstance(global_valid_seqs, Mapping):
            data, global_valid_seqs, global_valid_toks, next_token_logprobs = (
                global_valid_seqs, global_valid_toks, next_token_logprobs, data)
            if self.logprobs_from_logits is not None:
                kwargs["logits"], next_token_logprobs = next_token_logprobs, None
        if self.logprobs_from_logits is not None:
            if kwargs.get("logits") is None or next_token_logprobs is not None:
                got = ", ".join(sorted([*kwargs, *(["next_token_logprobs"] if next_token_logprobs is not None else [])]))
                raise ValueError(f"ReinforceZeroLossFn (input_type logit) needs logits=, got {got or 'nothing'}; "
                                 "NeMo RL passes them to a loss whose input_type is LossInputType.LOGIT")
            if "input_ids" not in data:
                raise ValueError("ReinforceZeroLossFn: data lacks key input_ids; NeMo RL's training data must carry it")
            next_token_logprobs = self.logprobs_from_logits(kwargs.pop("logits"), data["input_ids"])
        if next_token_logprobs is None:
            got = ", ".join(sorted(kwargs)) or "nothing"
            raise ValueError(f"ReinforceZeroLossFn needs next_token_logprobs (input_type logprob), got {got}; "
                             "call it with next_token_logprobs=[B, S-1] learner logprobs")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise ValueError(f"ReinforceZeroLossFn: data lacks key(s) {', '.join(missing)}; NeMo RL's "
                             f"training data must carry {', '.join(_REQUIRED)}")
        if global_valid_seqs is None or global_valid_toks is None:
            raise ValueError("ReinforceZeroLossFn needs global_valid_seqs and global_valid_toks (the whole "
                             "batch's counts, not None) so that microbatch losses add up to the batch loss")
        lp = next_token_logprobs
        b, s = data["input_ids"].shape
        if lp.shape != (b, s - 1):
            raise ValueError(f"ReinforceZeroLossFn: next_token_logprobs is {tuple(lp.shape)} but input_ids is "
                             f"[{b}, {s}]; it must be [B, S-1], scoring input_ids[:, 1:]")
        token_mask = data["token_mask"][:, 1:]
        mask = token_mask * data["sample_mask"].reshape(b, 1).to(token_mask.dtype)
        gen = data["generation_logprobs"][:, 1:]
        adv = data["advantages"]
        if adv.dim() == 2 and adv.shape[1] == s:
            adv = adv[:, 1:]
        elif adv.numel() == b:                              # one advantage per response: [B] or [B, 1]
            adv = adv.reshape(b, 1).expand(b, s - 1)
        else:
            raise ValueError(f"ReinforceZeroLossFn: advantages is {tuple(adv.shape)}; use [B, S] = [{b}, {s}] "
                             f"(per token, aligned with input_ids) or [B] = [{b}]")
        valid = mask != 0
        keep = data.get("curr_logprobs_keep_mask")
        if keep is not None and (valid & (keep == 0)).any():
            raise ValueError("ReinforceZeroLossFn: top-k/top-p filtered some sampled tokens' logprobs; "
                             "importance ratios need full-vocabulary logprobs: set top_k/top_p off")

        ref = lp if self.ratio_source == "current" else data["prev_logprobs"][:, 1:]
        w, rejected = importance_weights(ref, gen, mask, self.correction, **self.params)
        bad = valid & ~(torch.isfinite(lp.detach()) & torch.isfinite(adv))
        if bad.any():
            r, t = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"ReinforceZeroLossFn: non-finite learner logprob or advantage at (row {r}, token "
                             f"{t}); check the model's logits and the rewards")
        lpz = torch.where(valid, lp, torch.zeros_like(lp))      # padding may hold -inf
        per_tok = w.to(lpz.dtype) * adv.detach().to(lpz.dtype) * lpz
        g_seq = torch.as_tensor(global_valid_seqs, dtype=lpz.dtype, device=lpz.device).clamp(min=1)
        g_tok = torch.as_tensor(global_valid_toks, dtype=lpz.dtype, device=lpz.device).clamp(min=1)
        if self._token_level:
            loss = -per_tok.sum() / g_tok
        else:
            t_i = valid.sum(dim=1).clamp(min=1).to(lpz.dtype)
            loss = -(per_tok.sum(dim=1) / t_i).sum() / g_seq
        return loss, self._metrics(ref, gen, mask, rejected, loss, float(g_tok), data["sample_mask"])

    @staticmethod
    def _metrics(ref, gen, mask, rejected, loss, g_tok, sample_mask) -> dict[str, float]:
        m = mismatch_metrics(ref, gen, mask)
        n = m["n_tokens"]
        share = n / g_tok               # local mean * local count / global count = share of the global mean
        out = {k: m[k] * share for k in ("is_dev", "k1", "k3", "token_mult_prob_error")}
        out["gen_kl_error"] = out["k3"]
        out["rejection_rate"] = int(rejected.sum()) / g_tok
        # Extremes: NeMo RL's inf sentinels for a microbatch without valid tokens.
        out["probs_ratio_min"] = m["rho_min"] if n else float("inf")
        out["probs_ratio_max"] = m["rho_max"] if n else float("-inf")
        out["num_valid_samples"] = float(sample_mask.sum())
        out["loss"] = loss.item()
        return out
