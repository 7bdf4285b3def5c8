"""Mismatch metrics, decomposition, lag histogram, pass@1 and the peak/median tracker."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rz.metrics import RunningPeakMedian, decomposition, lag_histogram, mismatch_metrics

L = math.log


def test_mismatch_metrics_hand():
    # valid tokens: d = lp_a - lp_b = [log 2, -log 2] -> rho = [2, 0.5]; third token is padding holding nan
    lp_a = torch.tensor([[L(.5), L(.25), float("nan")]])
    lp_b = torch.tensor([[L(.25), L(.5), 0.0]])
    m = torch.tensor([[1, 1, 0]])
    x = mismatch_metrics(lp_a, lp_b, m)
    ln2 = math.log(2)
    assert x["k1"] == pytest.approx(0.0, abs=1e-7)                 # mean(-d) = (-ln2 + ln2) / 2
    assert x["k2"] == pytest.approx(ln2 ** 2 / 2, rel=1e-6)        # mean(d^2 / 2)
    assert x["k3"] == pytest.approx(0.25, rel=1e-6)               # ((2-1-ln2) + (0.5-1+ln2)) / 2
    assert x["is_dev"] == pytest.approx(0.75, rel=1e-6)           # (|2-1| + |0.5-1|) / 2
    assert x["rho_min"] == pytest.approx(0.5, rel=1e-6) and x["rho_max"] == pytest.approx(2.0, rel=1e-6)
    assert x["token_mult_prob_error"] == pytest.approx(2.0, rel=1e-6)   # mean exp(|d|) = (2 + 2) / 2
    assert x["chi2"] == pytest.approx(1.125, rel=1e-6)           # (4 + 0.25) / 2 - 1
    assert x["ess"] == pytest.approx(6.25 / 8.5, rel=1e-6)       # (2.5)^2 / (2 * 4.25)
    assert x["diff_tokens"] == 2 and x["n_tokens"] == 2
    assert x["max_abs_diff"] == pytest.approx(ln2, rel=1e-6)


def test_mismatch_metrics_identical_and_empty():
    lp = -torch.rand(3, 4)
    x = mismatch_metrics(lp, lp.clone(), torch.ones(3, 4))
    assert x["diff_tokens"] == 0 and x["k3"] == 0 and x["is_dev"] == 0 and x["ess"] == pytest.approx(1.0)
    assert x["token_mult_prob_error"] == 1.0 and x["rho_min"] == x["rho_max"] == 1.0
    e = mismatch_metrics(lp, lp + 1, torch.zeros(3, 4))
    assert e["n_tokens"] == 0 and e["k3"] == 0 and e["diff_tokens"] == 0


def test_diff_tokens_is_bitwise():
    a = torch.tensor([[-1.0, 0.0, -2.0]])
    b = a.clone()
    b[0, 0] = torch.nextafter(a[0, 0], torch.tensor(0.0))    # one ulp apart: a real kernel difference
    b[0, 1] = -0.0                                            # -0.0 == 0.0 numerically, not bitwise
    x = mismatch_metrics(a, b, torch.ones(1, 3))
    assert x["diff_tokens"] == 2
    assert x["max_abs_diff"] > 0 and x["max_abs_diff"] < 1e-6
    with pytest.raises(ValueError, match="same shape"):
        mismatch_metrics(a, b[:, :2], torch.ones(1, 3))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8), st.integers(0, 2**31 - 1), st.floats(1e-4, 1.0))
def test_metric_identities(b, n, seed, scale):
    g = torch.Generator().manual_seed(seed)
    lp_b = -torch.rand(b, n, generator=g, dtype=torch.float64)
    lp_a = lp_b + scale * torch.randn(b, n, generator=g, dtype=torch.float64)
    m = torch.ones(b, n)
    x = mismatch_metrics(lp_a, lp_b, m)
    rho = torch.exp(lp_a - lp_b)
    # k2, k3 are non-negative per sample; chi2 = mean(rho^2) - 1 is >= 0 only in expectation, so only >= -1
    assert x["k3"] >= 0 and x["k2"] >= 0 and x["chi2"] >= -1 and 0 < x["ess"] <= 1 + 1e-12
    assert x["chi2"] == pytest.approx((rho * rho).mean().item() - 1, rel=1e-9, abs=1e-15)
    assert x["k3"] == pytest.approx((rho - 1 - torch.log(rho)).mean().item(), rel=1e-9, abs=1e-15)
    assert x["is_dev"] == pytest.approx((rho - 1).abs().mean().item(), rel=1e-9, abs=1e-15)
    assert x["token_mult_prob_error"] >= 1.0
    # swapping the two sides flips k1's sign
    assert mismatch_metrics(lp_b, lp_a, m)["k1"] == pytest.approx(-x["k1"], rel=1e-9, abs=1e-15)


def test_k3_small_gaps_are_resolved():
    # float32 rho - 1 - log rho would cancel to 0 or noise for a 1e-6 gap; the float64/expm1 path gives d^2/2
    lp_b = torch.full((1, 4), -1.0)
    lp_a = lp_b + 1e-6
    x = mismatch_metrics(lp_a, lp_b, torch.ones(1, 4))
    d = (lp_a - lp_b).double()[0, 0].item()
    assert x["k3"] == pytest.approx(d * d / 2, rel=1e-3)


def test_decomposition_separates_kernel_from_lag():
    g = torch.Generator().manual_seed(0)
    at_version = -torch.rand(2, 5, generator=g)
    now = at_version + 0.01 * torch.randn(2, 5, generator=g)
    m = torch.ones(2, 5)
    # consistent kernels: the rollout recorded exactly the same-version recompute -> kernel terms are 0
    d = decomposition(at_version.clone(), now, at_version, m)
    assert d["kernel_diff_tokens"] == 0 and d["kernel_k3"] == 0.0
    assert d["lag_k3"] > 0 and d["lag_k3"] == pytest.approx(d["total_k3"])
    # negative control: one ulp of kernel mismatch on 3 tokens shows up as kernel_diff_tokens = 3
    rollout = at_version.clone()
    rollout[0, :3] = torch.nextafter(rollout[0, :3], torch.zeros(3))
    d = decomposition(rollout, now, at_version, m)
    assert d["kernel_diff_tokens"] == 3 and d["kernel_k3"] >= 0
    # lag alone: no update since the rollout -> lag_k3 = 0 while the kernel gap remains
    d = decomposition(rollout, at_version, at_version, m)
    assert d["lag_k3"] == 0.0 and d["kernel_diff_tokens"] == 3


def test_lag_histogram():
    assert lag_histogram([0, 1, 1, 2], max_lag=2) == [1, 2, 1]
    assert lag_histogram(torch.tensor([0, 0]), max_lag=3) == [2, 0, 0, 0]
    assert lag_histogram([], max_lag=0) == [0]
    with pytest.raises(ValueError, match="lag 3 at index 1 is outside"):
        lag_histogram([0, 3], max_lag=2)
    with pytest.raises(ValueError, match="max_lag"):
        lag_histogram([0], max_lag=-1)


def test_running_peak_median():
    r = RunningPeakMedian()
    assert r.summary()["n"] == 0 and r.ratio == 1.0
    for v in [1.0, 2.0, 3.0, 100.0, float("nan")]:
        r.update(v)
    # median of [1, 2, 3, 100] = 2.5, peak 100 -> D3 = 40
    assert r.peak == 100.0 and r.median == 2.5 and r.ratio == 40.0
    assert r.summary()["n_nonfinite"] == 1 and r.summary()["n"] == 4
    r2 = RunningPeakMedian()
    r2.load_state_dict(r.state_dict())
    assert r2.summary() == r.summary()
    z = RunningPeakMedian()
    z.update(0.0)
    z.update(0.0)
    z.update(1.0)
    assert z.ratio == math.inf
