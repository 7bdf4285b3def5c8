"""Mismatch and training metrics (listed in docs/contracts.md, 5). Pure functions on tensors and lists.

Convention: rho = exp(lp_learner - lp_rollout) per valid token. The KL estimators are of
KL(rollout || learner) with samples drawn from the rollout (Schulman's k1/k2/k3 estimators):
  k1 = -log rho,  k2 = (log rho)^2 / 2,  k3 = rho - 1 - log rho       (NeMo RL's gen_kl_error is k3)
Statistics are computed in float64 (k3 of a 1e-7 log-ratio is ~5e-15: float32 cancellation would drown it)
and returned as Python floats so they go straight into metrics.jsonl.
"""
from __future__ import annotations

import math
import statistics

import torch


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The float's bit pattern as an integer tensor, so -0.0 != 0.0 and equal nans compare equal."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return x.contiguous().view(ints[x.element_size()])


def _check(name: str, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
    if a.shape != b.shape or a.shape != mask.shape:
        raise ValueError(f"{name}: logprobs {tuple(a.shape)}, {tuple(b.shape)} and mask {tuple(mask.shape)} "
                         "must have the same shape; pass tensors aligned token by token")


def mismatch_metrics(lp_a: torch.Tensor, lp_b: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Token-level gap between two logprob tensors, lp_a = learner (target), lp_b = rollout (behaviour).

    Over the n valid tokens (mask != 0), with d = lp_a - lp_b and rho = exp(d):
      k1, k2, k3               means of -d, d^2/2, rho - 1 - d
      is_dev                   mean |rho - 1|
      rho_min, rho_max         extremes of rho
      token_mult_prob_error    mean exp(|d|)              (1.0 = identical; healthy 1.0-1.02)
      chi2                     mean(rho^2) - 1
      ess                      (sum rho)^2 / (n sum rho^2) (effective sample size as a fraction of n)
      diff_tokens              count of tokens whose two logprobs are not bitwise equal
      max_abs_diff             max |d|
      abs_diff_seq_mean        mean over the sequences (rows with a valid token) of each one's mean |d|
      n_tokens                 n
    With n = 0 the means are 0, rho_min = rho_max = ess = 1 (no evidence of a gap); check n_tokens.
    """
    _check("mismatch_metrics", lp_a, lp_b, mask)
    valid = mask.detach() != 0
    a, b = lp_a.detach()[valid], lp_b.detach()[valid]
    n = int(a.numel())
    if a.dtype == b.dtype:
        diff_tokens = int((_bits(a) != _bits(b)).sum())
    else:  # different dtypes: compare exact float64 values
        diff_tokens = int((a.double() != b.double()).sum())
    if n == 0:
        return dict(k1=0.0, k2=0.0, k3=0.0, is_dev=0.0, rho_min=1.0, rho_max=1.0, token_mult_prob_error=1.0,
                    chi2=0.0, ess=1.0, diff_tokens=0, max_abs_diff=0.0, abs_diff_seq_mean=0.0, n_tokens=0)
    d = a.double() - b.double()
    rho = torch.exp(d)
    em1 = torch.expm1(d)                    # rho - 1 without cancellation near rho = 1
    sum_rho, sum_rho2 = rho.sum(), (rho * rho).sum()
    rows = valid.reshape(-1, valid.shape[-1]) if valid.dim() else valid.reshape(1, 1)
    row_abs = torch.zeros(rows.shape, dtype=torch.float64, device=d.device)
    row_abs[rows] = d.abs()  # (valid[mask] is row-major: the same order as d)
    per_row = rows.sum(-1)
    seq_abs = (row_abs.sum(-1)[per_row > 0] / per_row[per_row > 0]).mean()
    return dict(
        k1=(-d).mean().item(),
        k2=(d * d / 2).mean().item(),
        k3=(em1 - d).mean().item(),
        is_dev=em1.abs().mean().item(),
        rho_min=rho.min().item(),
        rho_max=rho.max().item(),
        token_mult_prob_error=torch.exp(d.abs()).mean().item(),
        chi2=(sum_rho2 / n).item() - 1.0,
        ess=(sum_rho * sum_rho / (n * sum_rho2)).item() if sum_rho2 > 0 else 0.0,
        diff_tokens=diff_tokens,
        max_abs_diff=d.abs().max().item(),
        abs_diff_seq_mean=seq_abs.item(),
        n_tokens=n,
    )


def decomposition(lp_rollout: torch.Tensor, lp_learner_now: torch.Tensor,
                  lp_learner_at_rollout_version: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Split the rollout-to-learner gap into kernel mismatch and weight lag.

    lp_learner_at_rollout_version is the learner's recompute under the exact weights that generated the
    tokens, so its gap to lp_rollout is kernel mismatch alone (must be bitwise 0 in consistent mode), and
    its gap to lp_learner_now is lag alone.
      kernel_diff_tokens, kernel_k3, kernel_max_abs_diff   rollout   vs same-version recompute
      lag_k3, lag_is_dev                                   recompute vs current learner
      total_k3                                             rollout   vs current learner
    """
    _check("decomposition", lp_rollout, lp_learner_now, mask)
    _check("decomposition", lp_rollout, lp_learner_at_rollout_version, mask)
    kernel = mismatch_metrics(lp_learner_at_rollout_version, lp_rollout, mask)
    lag = mismatch_metrics(lp_learner_now, lp_learner_at_rollout_version, mask)
    total = mismatch_metrics(lp_learner_now, lp_rollout, mask)
    return dict(kernel_diff_tokens=kernel["diff_tokens"], kernel_k3=kernel["k3"],
                kernel_max_abs_diff=kernel["max_abs_diff"], lag_k3=lag["k3"], lag_is_dev=lag["is_dev"],
                total_k3=total["k3"], n_tokens=kernel["n_tokens"])


def routing_diff_tokens(rollout_experts: torch.Tensor, learner_experts: torch.Tensor, mask: torch.Tensor) -> int:
    """Generated tokens for which some MoE layer chose other experts at rollout than in the learner's recompute
    under the same weights ([B, T-1, layers * k] each, aligned with mask). 0 when the kernels are consistent;
    where it is not, the logprob gap includes a routing flip, not only rounding."""
    if rollout_experts.shape != learner_experts.shape:
        raise ValueError(
            f"routing_diff_tokens: rollout experts {tuple(rollout_experts.shape)} and learner experts "
            f"{tuple(learner_experts.shape)} differ in shape; both must be [B, T-1, MoE layers * k]"
        )
    differs = (rollout_experts.long() != learner_experts.long()).any(-1)
    return int((differs & mask.bool()).sum())


def lag_histogram(lags, max_lag: int) -> list[int]:
    """Counts of lag 0, 1, ..., max_lag (length max_lag + 1).

    A lag outside [0, max_lag] raises: the runtime must never train on it (docs/contracts.md, 4), so seeing one here
    means the queue let it through.
    """
    if not isinstance(max_lag, int) or max_lag < 0:
        raise ValueError(f"lag_histogram: max_lag must be an int >= 0, got {max_lag!r}")
    counts = [0] * (max_lag + 1)
    for i, lag in enumerate(lags):
        lag = int(lag)
        if not 0 <= lag <= max_lag:
            raise ValueError(f"lag_histogram: lag {lag} at index {i} is outside [0, {max_lag}]; "
                             "the trajectory queue must refuse it before training")
        counts[lag] += 1
    return counts


class RunningPeakMedian:
    """Tracks a per-update series (is_dev) and reports peak / median: the seed's "D3" figure.

    Non-finite values are counted in n_nonfinite and left out of peak and median, so one bad
    update cannot hide the shape of the rest of the run (it still shows in n_nonfinite).
    """

    def __init__(self) -> None:
        self.values: list[float] = []
        self.n_nonfinite = 0

    def update(self, value: float) -> None:
        value = float(value)
        if math.isfinite(value):
            self.values.append(value)
        else:
            self.n_nonfinite += 1

    @property
    def peak(self) -> float:
        return max(self.values) if self.values else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else 0.0

    @property
    def ratio(self) -> float:
        """peak / median; inf when the median is 0 but the peak is not, 1 for an all-zero series."""
        med, pk = self.median, self.peak
        if med > 0:
            return pk / med
        return math.inf if pk > 0 else 1.0

    def summary(self) -> dict[str, float]:
        return dict(peak=self.peak, median=self.median, peak_over_median=self.ratio, n=len(self.values),
                    n_nonfinite=self.n_nonfinite)

    def state_dict(self) -> dict:
        return {"values": list(self.values), "n_nonfinite": self.n_nonfinite}

    def load_state_dict(self, state: dict) -> None:
        self.values = [float(v) for v in state["values"]]
        self.n_nonfinite = int(state["n_nonfinite"])
