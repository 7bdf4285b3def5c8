"""Per-token importance weights that correct rollout-vs-learner mismatch.

rho_t = pi_learner(y_t) / mu_rollout(y_t) = exp(lp_learner_t - lp_rollout_t), per valid token.
REINFORCE Zero uses `unclipped` (rho as is). The others are the baselines it is compared against, with the
defaults their sources use (TIS, IcePop, NeMo RL's sequence gate, FlashREINFORCE, the CIS paper):

  none         w = 1
  unclipped    w = rho                                               (REINFORCE Zero)
  tis          w = min(rho, C)                                        C = 2
  token_mask   w = rho if a <= rho <= b else 0                        a = 0.5, b = 5 (IcePop)
  seq_gate     w = rho if lo <= exp(mean_t log rho) <= hi else 0      lo = 0.999, hi = 1.002
  seq_gate_kl  w = rho if mean_t KLb(p_t, q_t) <= delta else 0        delta = 3e-3 (FlashREINFORCE)
               KLb(p, q) = p log(p/q) + (1-p) log((1-p)/(1-q)), p = exp(lp_learner), q = exp(lp_rollout)
  cis          w = min(k, 1 + lam * max(1 - p, kappa)), k = p/q     lam = 2.3, kappa = 5e-3
               non-finite log k -> w = 1 (Calibrated IS; only the upper side is cut)

Weights are always detached: the loss multiplies them into the score function, it never
differentiates through them. Padded tokens get weight 0 and are never "rejected".
A non-finite ratio on a valid token is a bug upstream (temperature or top-k/top-p mismatch, a token the
rollout gave probability 0), so every method but `none` and `cis` raises NonFiniteRatioError
instead of clipping it away.

Each method is a Correction registered by name (nemo_rz.plugins): another package adds one the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from nemo_rz import plugins
from nemo_rz.errors import NonFiniteRatioError


@dataclasses.dataclass(frozen=True)
class Correction:
    """What a registered correction is (entry point `correction.<name>`, see docs/plugins.md).

    weights(lp_learner, lp_rollout, valid, **params) -> (w [B, T], rejected [B, T] bool, or None when it never
    rejects): lp_* are detached, at least float32, 0 on padding; valid is [B, T] bool. params are `defaults`
    overridden by algo.correction_params; check(params) returns what is wrong with them, or None.
    finite_ratios: valid tokens with a non-finite ratio raise NonFiniteRatioError before weights() runs.
    """
    weights: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    defaults: dict[str, float] = dataclasses.field(default_factory=dict)
    check: Callable[[dict[str, float]], str | None] = lambda p: None
    finite_ratios: bool = True


def correction(method: str) -> Correction:
    """The correction registered as `method` (a built-in or a plugin's); ValueError when there is none."""
    found = plugins.load("correction", method)
    if not isinstance(found, Correction):
        raise plugins.PluginError(f"correction {method!r} is a {type(found).__name__}, not a "
                                  "nemo_rz.algorithms.Correction; see docs/plugins.md")
    return found


def correction_params(method: str, params: dict | None = None) -> dict[str, float]:
    """The method's parameters: defaults overridden by `params`; unknown names or bad values raise."""
    allowed = correction(method).defaults
    params = dict(params or {})
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        valid = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for correction {method!r}: "
                         f"valid parameters are {valid}")
    p = {k: float(params.get(k, v)) for k, v in allowed.items()}
    bad = correction(method).check(p)
    if bad:
        raise ValueError(f"bad parameter for correction {method!r}: {bad}")
    return p


def _rho(lp_l: torch.Tensor, lp_r: torch.Tensor) -> torch.Tensor:
    return torch.exp(lp_l - lp_r)


def _gated(rho: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor):
    """Whole responses kept or gated out; kept ones keep the raw token ratios."""
    keep = keep | (valid.sum(dim=1) == 0)  # nothing to gate in an empty response
    return rho * keep.unsqueeze(1), valid & ~keep.unsqueeze(1)


def _seq_gate(lp_l, lp_r, valid, lo, hi):
    log_rho = lp_l - lp_r
    stat = torch.exp((log_rho * valid).sum(dim=1) / valid.sum(dim=1).clamp(min=1))   # geometric mean of rho
    return _gated(torch.exp(log_rho), valid, (stat >= lo) & (stat <= hi))


def _seq_gate_kl(lp_l, lp_r, valid, delta):
    # p, 1-p, 1-q; expm1 is exact near p = 1, the clamp stops a rounding-positive logprob from making log(1-p) nan
    p_l = torch.exp(lp_l)
    omp, omq = (-torch.expm1(lp_l)).clamp(min=0), (-torch.expm1(lp_r)).clamp(min=0)
    # xlogy(0, .) = 0 keeps the p = 1 tokens finite; q = 1 with p < 1 gives +inf (gated out).
    kl = p_l * (lp_l - lp_r) + torch.special.xlogy(omp, omp) - torch.special.xlogy(omp, omq)
    stat = torch.where(valid, kl, torch.zeros_like(kl)).sum(dim=1) / valid.sum(dim=1).clamp(min=1)
    return _gated(_rho(lp_l, lp_r), valid, stat <= delta)


def _token_mask(lp_l, lp_r, valid, a, b):
    rho = _rho(lp_l, lp_r)
    keep = (rho >= a) & (rho <= b)
    return torch.where(keep, rho, torch.zeros_like(rho)), valid & ~keep


def _cis(lp_l, lp_r, valid, lam, kappa):
    log_rho = lp_l - lp_r
    cap = 1.0 + lam * (-torch.expm1(lp_l)).clamp(min=kappa)   # 1 - p, exact near p = 1
    return torch.where(torch.isfinite(log_rho), torch.minimum(torch.exp(log_rho), cap), torch.ones_like(log_rho)), None


def _need(ok: bool, text: str) -> str | None:
    return None if ok else text


# The built-ins, registered in setup.py (entry points correction.<name>) like any plugin's.
NONE = Correction(lambda lp_l, lp_r, valid: (torch.ones_like(lp_l), None), finite_ratios=False)
UNCLIPPED = Correction(lambda lp_l, lp_r, valid: (_rho(lp_l, lp_r), None))
TIS = Correction(lambda lp_l, lp_r, valid, C: (_rho(lp_l, lp_r).clamp(max=C), None), {"C": 2.0},
                 lambda p: _need(p["C"] > 0, f"C must be > 0, got {p['C']}"))
TOKEN_MASK = Correction(_token_mask, {"a": 0.5, "b": 5.0},
                        lambda p: _need(0 <= p["a"] <= p["b"], f"need 0 <= a <= b, got a={p['a']} b={p['b']}"))
SEQ_GATE = Correction(_seq_gate, {"lo": 0.999, "hi": 1.002},
                      lambda p: _need(0 < p["lo"] <= p["hi"], f"need 0 < lo <= hi, got lo={p['lo']} hi={p['hi']}"))
SEQ_GATE_KL = Correction(_seq_gate_kl, {"delta": 3e-3},
                         lambda p: _need(p["delta"] >= 0, f"delta must be >= 0, got {p['delta']}"))
# lambda is a Python keyword, so CIS takes `lam`; only its upper side is cut, a non-finite log k gives w = 1.
CIS = Correction(_cis, {"lam": 2.3, "kappa": 5e-3}, lambda p: _need(
    p["lam"] >= 0 and 0 < p["kappa"] <= 1, f"need lam >= 0 and 0 < kappa <= 1, got lam={p['lam']} kappa={p['kappa']}"),
    finite_ratios=False)
CORRECTIONS = plugins.Registry("correction")  # every registered name: the built-ins above, then plugins'


def _check_shapes(lp_l: torch.Tensor, lp_r: torch.Tensor, mask: torch.Tensor) -> None:
    if lp_l.dim() != 2 or lp_l.shape != lp_r.shape or lp_l.shape != mask.shape:
        raise ValueError(f"importance_weights: learner_logprobs {tuple(lp_l.shape)}, rollout_logprobs "
                         f"{tuple(lp_r.shape)} and mask {tuple(mask.shape)} must all be the same [B, T]; "
                         "align the rollout's recorded logprobs with the learner's tokens")


def _raise_non_finite(bad: torch.Tensor, lp_l: torch.Tensor, lp_r: torch.Tensor, method: str) -> None:
    r, t = (int(x) for x in bad.nonzero()[0])
    raise NonFiniteRatioError(
        f"non-finite importance ratio in correction {method!r}: {int(bad.sum())} valid token(s), first at "
        f"(row {r}, token {t}) with learner logprob {lp_l[r, t].item()} and rollout logprob "
        f"{lp_r[r, t].item()}; check that both sides use the same temperature and full-vocabulary "
        "logprobs, or mask that token out")


def importance_weights(learner_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       method: str = "unclipped", **params) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights and rejections for one batch; see the module docstring for the formulas.

    learner_logprobs, rollout_logprobs: [B, T] log-probs of the sampled tokens; mask: [B, T] (1 = valid).
    Returns (weights [B, T] float, detached, 0 on padding; rejected [B, T] bool: valid tokens whose
    weight a gate set to 0 - token_mask's out-of-range tokens, every token of a gated-out response).
    """
    p = correction_params(method, params)
    _check_shapes(learner_logprobs, rollout_logprobs, mask)
    found = correction(method)
    valid = mask.detach() != 0
    # Ratios in at least fp32: exp of a bf16 difference is too coarse to tell 1.001 from 1.
    dtype = torch.promote_types(learner_logprobs.dtype, torch.float32)
    with torch.no_grad():
        zero = torch.zeros((), dtype=dtype, device=learner_logprobs.device)
        # Padding may hold anything (-inf, nan): replace it before any arithmetic touches it.
        lp_l = torch.where(valid, learner_logprobs.detach().to(dtype), zero)
        lp_r = torch.where(valid, rollout_logprobs.detach().to(dtype), zero)
        if found.finite_ratios:
            log_rho = lp_l - lp_r
            bad = valid & ~(torch.isfinite(log_rho) & torch.isfinite(torch.exp(log_rho)))
            if bad.any():
                _raise_non_finite(bad, learner_logprobs, rollout_logprobs, method)
        w, rejected = found.weights(lp_l, lp_r, valid, **p)
        if not isinstance(w, torch.Tensor) or w.shape != valid.shape:
            raise ValueError(f"correction {method!r} returned weights of shape {tuple(getattr(w, 'shape', ()))}, "
                             f"not the batch's {tuple(valid.shape)}")
        bad = valid & ~torch.isfinite(w)
        if bad.any():
            raise NonFiniteRatioError(f"correction {method!r} gave {int(bad.sum())} valid token(s) a non-finite weight")
        w = torch.where(valid, w.to(dtype), zero)
        rejected = valid & (torch.zeros_like(valid) if rejected is None else rejected.to(torch.bool))
    return w, rejected
