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
"""
from __future__ import annotations

import torch

# lambda is a Python keyword, so CIS takes `lam`.
_DEFAULTS: dict[str, dict[str, float]] = {
    "none": {},
    "unclipped": {},
    "tis": {"C": 2.0},
    "token_mask": {"a": 0.5, "b": 5.0},
    "seq_gate": {"lo": 0.999, "hi": 1.002},
    "seq_gate_kl": {"delta": 3e-3},
    "cis": {"lam": 2.3, "kappa": 5e-3},
}
CORRECTIONS: tuple[str, ...] = tuple(_DEFAULTS)


class NonFiniteRatioError(ValueError):
    """A valid token has an inf/nan importance ratio (or log-ratio)."""


def correction_params(method: str, params: dict | None = None) -> dict[str, float]:
    """The method's parameters: defaults overridden by `params`; unknown names or bad values raise."""
    if method not in _DEFAULTS:
        raise ValueError(f"unknown correction {method!r}: use one of {', '.join(CORRECTIONS)}")
    params = dict(params or {})
    allowed = _DEFAULTS[method]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        valid = ", ".join(allowed) if allowed else "none"
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for correction {method!r}: "
                         f"valid parameters are {valid}")
    p = {k: float(params.get(k, v)) for k, v in allowed.items()}
    bad = None
    if method == "tis" and not p["C"] > 0:
        bad = f"C must be > 0, got {p['C']}"
    elif method == "token_mask" and not 0 <= p["a"] <= p["b"]:
        bad = f"need 0 <= a <= b, got a={p['a']} b={p['b']}"
    elif method == "seq_gate" and not 0 < p["lo"] <= p["hi"]:
        bad = f"need 0 < lo <= hi, got lo={p['lo']} hi={p['hi']}"
    elif method == "seq_gate_kl" and not p["delta"] >= 0:
        bad = f"delta must be >= 0, got {p['delta']}"
    elif method == "cis" and not (p["lam"] >= 0 and 0 < p["kappa"] <= 1):
        bad = f"need lam >= 0 and 0 < kappa <= 1, got lam={p['lam']} kappa={p['kappa']}"
    if bad:
        raise ValueError(f"bad parameter for correction {method!r}: {bad}")
    return p


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
    valid = mask.detach() != 0
    # Ratios in at least fp32: exp of a bf16 difference is too coarse to tell 1.001 from 1.
    dtype = torch.promote_types(learner_logprobs.dtype, torch.float32)
    with torch.no_grad():
        zero = torch.zeros((), dtype=dtype, device=learner_logprobs.device)
        # Padding may hold anything (-inf, nan): replace it before any arithmetic touches it.
        lp_l = torch.where(valid, learner_logprobs.detach().to(dtype), zero)
        lp_r = torch.where(valid, rollout_logprobs.detach().to(dtype), zero)
        log_rho = lp_l - lp_r
        rho = torch.exp(log_rho)
        if method not in ("none", "cis"):
            bad = valid & ~(torch.isfinite(log_rho) & torch.isfinite(rho))
            if bad.any():
                _raise_non_finite(bad, learner_logprobs, rollout_logprobs, method)

        rejected = torch.zeros_like(valid)
        if method == "none":
            w = torch.ones_like(rho)
        elif method == "unclipped":
            w = rho
        elif method == "tis":
            w = rho.clamp(max=p["C"])
        elif method == "token_mask":
            keep = (rho >= p["a"]) & (rho <= p["b"])
            w = torch.where(keep, rho, zero)
            rejected = valid & ~keep
        elif method in ("seq_gate", "seq_gate_kl"):
            n = valid.sum(dim=1)
            if method == "seq_gate":
                stat = torch.exp((log_rho * valid).sum(dim=1) / n.clamp(min=1))   # geometric mean of rho
                keep = (stat >= p["lo"]) & (stat <= p["hi"])
            else:
                # p, 1-p, 1-q; expm1 is exact near p = 1, the clamp stops a rounding-positive logprob
                # from making log(1-p) nan
                p_l = torch.exp(lp_l)
                omp, omq = (-torch.expm1(lp_l)).clamp(min=0), (-torch.expm1(lp_r)).clamp(min=0)
                # xlogy(0, .) = 0 keeps the p = 1 tokens finite; q = 1 with p < 1 gives +inf (gated out).
                kl = p_l * log_rho + torch.special.xlogy(omp, omp) - torch.special.xlogy(omp, omq)
                stat = torch.where(valid, kl, zero).sum(dim=1) / n.clamp(min=1)
                keep = stat <= p["delta"]
            keep = keep | (n == 0)                      # nothing to gate in an empty response
            w = rho * keep.unsqueeze(1)                 # kept responses keep the raw token ratios
            rejected = valid & ~keep.unsqueeze(1)
        else:  # cis
            omp = -torch.expm1(lp_l)                    # 1 - p, exact near p = 1
            cap = 1.0 + p["lam"] * omp.clamp(min=p["kappa"])
            w = torch.where(torch.isfinite(log_rho), torch.minimum(rho, cap), torch.ones_like(rho))
        w = torch.where(valid, w, zero)
    return w, rejected
