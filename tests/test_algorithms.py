"""Advantages, corrections, losses and the NeMo RL adapter: hand-worked numbers and properties."""
import enum
import math
import sys
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rz.algorithms import (
    CORRECTIONS,
    NonFiniteRatioError,
    ReinforceZeroLossFn,
    group_advantages,
    importance_weights,
    ppo_clip_loss,
    reinforce_zero_loss,
)

F64 = torch.float64
L = math.log


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


# ---------------------------------------------------------------- advantages

def test_group_advantages_hand():
    # group 1: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; group 2: all equal -> 0
    a = group_advantages(t([1, 0, 0, 1, 1, 1, 1, 1]), 4)
    assert torch.allclose(a, t([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # std variant: population std of {1,0,0,1} is 0.5 -> [1,-1,-1,1] / (1 + 2e-6)
    a = group_advantages(t([1, 0, 0, 1]), 4, normalize_std=True, eps=1e-6)
    assert torch.allclose(a, t([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-6))
    # integer rewards are accepted; a group of one has advantage 0
    assert torch.equal(group_advantages(torch.tensor([3, 5]), 1), torch.zeros(2))


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        group_advantages(t([1, 0, 1]), 4)
    with pytest.raises(ValueError, match="non-finite reward.*index 1"):
        group_advantages(t([1, float("nan")]), 2)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(t([1, 0]), 0)
    with pytest.raises(ValueError, match="1-D"):
        group_advantages(t([[1, 0]]), 2)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_group_advantages_sum_to_zero(groups, size, seed):
    r = torch.rand(groups * size, generator=torch.Generator().manual_seed(seed), dtype=F64)
    a = group_advantages(r, size).reshape(groups, size)
    assert torch.allclose(a.sum(1), torch.zeros(groups, dtype=F64), atol=1e-12)
    assert torch.allclose(a, r.reshape(groups, size) - r.reshape(groups, size).mean(1, keepdim=True))


# ---------------------------------------------------------------- corrections: hand-worked weights

def lp_pair(rhos, p_learner=0.5):
    """learner logprob log p, rollout logprob log(p / rho): ratio rho (up to rounding)."""
    lp_l = t([[L(p_learner)] * len(rhos)])
    lp_r = lp_l - t([[L(r) for r in rhos]])
    return lp_l, lp_r


def test_none_unclipped_tis():
    # rho = p/q: 0.6/0.2 = 3, 0.2/0.4 = 0.5, 0.9/0.9 = 1; last token is padding holding -inf
    lp_l = t([[L(.6), L(.2), L(.9), float("-inf")]])
    lp_r = t([[L(.2), L(.4), L(.9), float("-inf")]])
    m = t([[1, 1, 1, 0]])
    w, rej = importance_weights(lp_l, lp_r, m, "none")
    assert torch.equal(w, t([[1, 1, 1, 0]])) and not rej.any()
    w, rej = importance_weights(lp_l, lp_r, m, "unclipped")
    assert torch.allclose(w, t([[3, .5, 1, 0]])) and not rej.any()
    w, _ = importance_weights(lp_l, lp_r, m, "tis")          # C = 2: min(3, 2) = 2
    assert torch.allclose(w, t([[2, .5, 1, 0]]))
    w, _ = importance_weights(lp_l, lp_r, m, "tis", C=1.5)   # min(3, 1.5) = 1.5
    assert torch.allclose(w, t([[1.5, .5, 1, 0]]))


def test_token_mask():
    # rho: 3 kept, 0.5 kept (a is inclusive), 6 > b=5 rejected, 0.4 < a=0.5 rejected, padding not rejected
    lp_l = t([[L(.6), L(.2), L(.6), L(.2), 0.0]])
    lp_r = t([[L(.2), L(.4), L(.1), L(.5), 0.0]])
    m = t([[1, 1, 1, 1, 0]])
    w, rej = importance_weights(lp_l, lp_r, m, "token_mask")
    assert torch.allclose(w, t([[3, .5, 0, 0, 0]]))
    assert rej.tolist() == [[False, False, True, True, False]]
    # b inclusive too: rho = 2 exactly with b = 2 is kept
    w, rej = importance_weights(t([[L(.5)]]), t([[L(.25)]]), t([[1]]), "token_mask", a=0.5, b=2.0)
    assert w.item() == 2.0 and not rej.any()


def test_seq_gate():
    # row 0: log rho = [+1e-3, -1e-3]  -> geometric mean 1.0        in [0.999, 1.002] -> kept, raw ratios
    # row 1: log rho = [1e-2, 0]       -> exp(5e-3) = 1.00501        > 1.002           -> rejected
    # row 2: log rho = [-2e-3, 0]      -> exp(-1e-3) = 0.9990005    >= 0.999          -> kept
    # row 3: no valid tokens                                                          -> kept, weight 0
    lp_l = t([[-1.0, -1.0, float("nan")], [-1.0, -1.0, 0], [-1.0, -1.0, 0], [0, 0, 0]])
    log_rho = t([[1e-3, -1e-3, 0], [1e-2, 0, 0], [-2e-3, 0, 0], [0, 0, 0]])
    m = t([[1, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    w, rej = importance_weights(lp_l, lp_l - log_rho, m, "seq_gate")
    assert torch.allclose(w[0, :2], torch.exp(log_rho[0, :2])) and w[0, 2] == 0
    assert torch.equal(w[1], torch.zeros(3, dtype=F64))
    assert torch.allclose(w[2, :2], torch.exp(log_rho[2, :2]))
    assert rej.tolist() == [[False] * 3, [True, True, False], [False] * 3, [False] * 3]
    # lo above row 2's 0.9990005 gates row 2 out; row 0 (geometric mean 1) stays
    _, rej = importance_weights(lp_l, lp_l - log_rho, m, "seq_gate", lo=0.9995)
    assert rej[2, :2].all() and not rej[0].any()


def test_seq_gate_kl():
    # Bernoulli KL(p || q) = p log(p/q) + (1-p) log((1-p)/(1-q)):
    #   p=.5, q=.4  -> 0.5 log(1.25) + 0.5 log(0.8333) = 0.0204110  > 3e-3
    #   p=.5, q=.49 -> 0.5 log(0.5/.49) + 0.5 log(0.5/.51) = 2.0004e-4 <= 3e-3
    #   p=.9, q=.9  -> 0
    #   p=1,  q=1   -> 0 (the (1-p) log(...) term is 0 * log(0/0) := 0)
    # row 0 = [(.5,.4), (.9,.9)]: mean 0.0102055 -> rejected; row 1 = [(.5,.49), (1,1)]: mean 1.0e-4 -> kept
    lp_l = t([[L(.5), L(.9)], [L(.5), 0.0]])
    lp_r = t([[L(.4), L(.9)], [L(.49), 0.0]])
    m = torch.ones(2, 2, dtype=torch.bool)
    w, rej = importance_weights(lp_l, lp_r, m, "seq_gate_kl")
    assert torch.equal(w[0], torch.zeros(2, dtype=F64)) and rej[0].all()
    assert torch.allclose(w[1], t([.5 / .49, 1.0])) and not rej[1].any()
    # delta above row 0's mean keeps it
    w, rej = importance_weights(lp_l, lp_r, m, "seq_gate_kl", delta=0.011)
    assert not rej.any() and torch.allclose(w[0], t([1.25, 1.0]))


def test_cis():
    # f = min(k, 1 + 2.3 * max(1 - p, 5e-3)), k = p/q:
    #   p=.5,  q=.1  : k=5,    cap 2.15    -> 2.15
    #   p=.9,  q=.5  : k=1.8,  cap 1.23    -> 1.23
    #   p=.999,q=.9  : k=1.11, cap 1.0115  -> 1.0115  (1-p = 1e-3 < kappa)
    #   p=.3,  q=.6  : k=0.5               -> 0.5     (only the upper side is cut)
    #   p=0 (lp=-inf): log k = -inf        -> 1
    #   q=0 (lp=-inf): log k = +inf        -> 1
    lp_l = t([[L(.5), L(.9), L(.999), L(.3), float("-inf"), L(.5)]])
    lp_r = t([[L(.1), L(.5), L(.9), L(.6), L(.5), float("-inf")]])
    w, rej = importance_weights(lp_l, lp_r, torch.ones(1, 6), "cis")
    assert torch.allclose(w, t([[2.15, 1.23, 1.0115, 0.5, 1.0, 1.0]]))
    assert not rej.any()
    # caps the CIS paper quotes: p=0.5 -> 2.15, p=0.9 -> 1.23, p>=0.995 -> 1.0115 (k huge so the cap binds)
    lp_l = t([[L(.5), L(.9), L(.995), L(.9999)]])
    w, _ = importance_weights(lp_l, lp_l - 10, torch.ones(1, 4), "cis")
    assert torch.allclose(w, t([[2.15, 1.23, 1.0115, 1.0115]]))


def test_weights_detached_and_padding_zero():
    g = torch.Generator().manual_seed(0)
    lp_l = (-torch.rand(3, 5, generator=g, dtype=F64)).requires_grad_()
    lp_r = lp_l.detach() - 0.01 * torch.randn(3, 5, generator=g, dtype=F64)
    m = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    for method in CORRECTIONS:
        w, rej = importance_weights(lp_l, lp_r, m, method, **({"lo": 0.9, "hi": 1.1} if method == "seq_gate" else {}))
        assert not w.requires_grad and w.grad_fn is None, method
        assert torch.equal(w[m == 0], torch.zeros(int((m == 0).sum()), dtype=F64)), method
        assert not rej[m == 0].any(), method


def test_non_finite_ratio_raises():
    lp_l = t([[-1.0, -1.0], [-1.0, -1.0]])
    lp_r = t([[-1.0, -1.0], [float("-inf"), -1.0]])
    m = torch.ones(2, 2)
    for method in ("unclipped", "tis", "token_mask", "seq_gate", "seq_gate_kl"):
        with pytest.raises(NonFiniteRatioError, match=r"1 valid token\(s\), first at \(row 1, token 0\)"):
            importance_weights(lp_l, lp_r, m, method)
    # ratio overflow in fp32 (exp(100) = inf) is an error too, never clipped away
    with pytest.raises(NonFiniteRatioError):
        importance_weights(torch.zeros(1, 1), torch.full((1, 1), -100.0), torch.ones(1, 1), "tis")
    # NonFiniteRatioError is a ValueError, and the message is one line
    with pytest.raises(ValueError) as e:
        importance_weights(lp_l, lp_r, m, "unclipped")
    assert "\n" not in str(e.value)
    # negative controls: the same bad token behind the mask, or under none / cis, does not raise
    importance_weights(lp_l, lp_r, t([[1, 1], [0, 1]]), "unclipped")
    importance_weights(lp_l, lp_r, m, "none")
    importance_weights(lp_l, lp_r, m, "cis")


def test_unknown_method_and_params():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="unknown correction 'clip'.*unclipped, tis"):
        importance_weights(x, x, torch.ones(1, 2), "clip")
    with pytest.raises(ValueError, match="unknown parameter.*c for correction 'tis': valid parameters are C"):
        importance_weights(x, x, torch.ones(1, 2), "tis", c=2.0)
    with pytest.raises(ValueError, match="valid parameters are none"):
        importance_weights(x, x, torch.ones(1, 2), "unclipped", C=2.0)
    with pytest.raises(ValueError, match="a <= b"):
        importance_weights(x, x, torch.ones(1, 2), "token_mask", a=3.0, b=2.0)
    with pytest.raises(ValueError, match="same"):
        importance_weights(x, torch.zeros(1, 3), torch.ones(1, 2))
    assert set(CORRECTIONS) == {"none", "unclipped", "tis", "token_mask", "seq_gate", "seq_gate_kl", "cis"}


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1), st.floats(0.0, 0.5))
def test_correction_properties(b, n, seed, scale):
    g = torch.Generator().manual_seed(seed)
    lp_l = -torch.rand(b, n, generator=g, dtype=F64) * 3
    lp_r = lp_l - scale * torch.randn(b, n, generator=g, dtype=F64)
    m = (torch.rand(b, n, generator=g) < 0.7).to(F64)
    rho = torch.exp(lp_l - lp_r) * m
    w, _ = importance_weights(lp_l, lp_r, m, "unclipped")
    assert torch.allclose(w, rho)
    w, _ = importance_weights(lp_l, lp_r, m, "tis")
    assert (w <= 2.0).all() and torch.allclose(w, rho.clamp(max=2.0))
    # gates: every response keeps its raw ratios or loses all of them
    for method in ("seq_gate", "seq_gate_kl"):
        w, rej = importance_weights(lp_l, lp_r, m, method)
        for i in range(b):
            assert torch.allclose(w[i], rho[i]) or (torch.equal(w[i], torch.zeros(n, dtype=F64))
                                                    and rej[i].eq(m[i] != 0).all())
    # CIS never exceeds its cap and never raises a weight above k
    w, _ = importance_weights(lp_l, lp_r, m, "cis")
    cap = 1 + 2.3 * (1 - torch.exp(lp_l)).clamp(min=5e-3)
    assert (w <= cap * m + 1e-12).all() and (w <= rho + 1e-12).all()


# ---------------------------------------------------------------- losses

def loss_batch():
    # row 0: 2 valid tokens, learner p = [.5, .25], rollout q = [.25, .5] -> rho = [2, 0.5]; padding -inf
    # row 1: 3 valid tokens, learner == rollout p = [.8, .5, .5]        -> rho = 1
    lp_l = t([[L(.5), L(.25), float("-inf")], [L(.8), L(.5), L(.5)]]).requires_grad_()
    lp_r = t([[L(.25), L(.5), float("-inf")], [L(.8), L(.5), L(.5)]])
    m = t([[1, 1, 0], [1, 1, 1]])
    adv = t([0.5, -0.5])
    return lp_l, lp_r, adv, m


def test_reinforce_zero_loss_hand():
    lp_l, lp_r, adv, m = loss_batch()
    # row 0: (1/2) * 0.5 * (2 log .5 + 0.5 log .25)   = -0.519860
    # row 1: (1/3) * -0.5 * (log .8 + 2 log .5)       = +0.268240
    # L = -(1/2) (-0.519860 + 0.268240)               = 0.125810
    loss, met = reinforce_zero_loss(lp_l, lp_r, adv, m)
    assert loss.item() == pytest.approx(0.12581036667380444, abs=1e-12)
    assert met["loss"] == pytest.approx(0.12581036667380444)
    # is_dev = mean |rho - 1| over 5 valid tokens = (1 + 0.5 + 0 + 0 + 0) / 5 = 0.3
    assert met["is_dev"] == pytest.approx(0.3) and met["rho_min"] == pytest.approx(0.5)
    assert met["rho_max"] == pytest.approx(2.0) and met["rejection_rate"] == 0.0
    # k1 = mean(-log rho) = (-log 2 + log 2) / 5 = 0; k3 = ((1 - log 2) + (-0.5 + log 2)) / 5 = 0.1
    assert met["k1"] == pytest.approx(0.0, abs=1e-12) and met["k3"] == pytest.approx(0.1)
    # TIS with C = 1.5: row 0 weights [1.5, 0.5] -> L = 0.0824887
    loss, _ = reinforce_zero_loss(lp_l, lp_r, adv, m, correction="tis", C=1.5)
    assert loss.item() == pytest.approx(0.08248866788880785, abs=1e-12)


def test_reinforce_zero_gradient_is_detached_weight():
    lp_l, lp_r, adv, m = loss_batch()
    loss, _ = reinforce_zero_loss(lp_l, lp_r, adv, m)
    loss.backward()
    # dL/dlp_t = -(1/B)(1/T_i) w_t A_i: row 0 -(1/2)(1/2)(0.5)[2, 0.5]; row 1 -(1/2)(1/3)(-0.5)[1, 1, 1]
    expect = t([[-0.25, -0.0625, 0.0], [1 / 12, 1 / 12, 1 / 12]])
    assert torch.allclose(lp_l.grad, expect, atol=1e-12)
    # negative control: a weight that is NOT detached adds d rho / d lp = rho to the gradient
    lp2 = lp_l.detach().clone().requires_grad_()
    rho = torch.exp(torch.where(m > 0, lp2 - lp_r, torch.zeros_like(lp2)))
    bad = -((rho * adv[:, None] * torch.where(m > 0, lp2, torch.zeros_like(lp2))).sum(1) / m.sum(1)).mean()
    bad.backward()
    assert not torch.allclose(lp2.grad, expect, atol=1e-6)


def test_loss_empty_response_and_all_methods_finite():
    lp_l, lp_r, adv, m = loss_batch()
    lp3 = torch.cat([lp_l.detach(), t([[0.0, 0.0, 0.0]])]).requires_grad_()
    r3 = torch.cat([lp_r, t([[float("nan")] * 3])])
    m3 = torch.cat([m, t([[0, 0, 0]])])
    loss, _ = reinforce_zero_loss(lp3, r3, t([0.5, -0.5, 7.0]), m3)
    # the empty row contributes 0 but B = 3 counts it: (2/3) of the 2-row loss
    assert loss.item() == pytest.approx(0.12581036667380444 * 2 / 3)
    loss.backward()
    assert torch.isfinite(lp3.grad).all() and torch.equal(lp3.grad[2], torch.zeros(3, dtype=F64))
    for method in CORRECTIONS:
        params = {"lo": 0.4, "hi": 3.0} if method == "seq_gate" else {}
        loss, met = reinforce_zero_loss(lp_l, lp_r, adv, m, correction=method, **params)
        assert math.isfinite(loss.item()) and 0 <= met["rejection_rate"] <= 1, method


def test_loss_errors():
    lp_l, lp_r, adv, m = loss_batch()
    with pytest.raises(ValueError, match="advantages"):
        reinforce_zero_loss(lp_l, lp_r, t([1.0, 2.0, 3.0]), m)
    with pytest.raises(ValueError, match="non-finite advantage"):
        reinforce_zero_loss(lp_l, lp_r, t([float("inf"), 0.0]), m)
    bad = lp_r.clone()
    bad[1, 2] = float("-inf")
    with pytest.raises(NonFiniteRatioError, match=r"\(row 1, token 2\)"):
        reinforce_zero_loss(lp_l, bad, adv, m)
    with pytest.raises(ValueError, match="non-finite learner logprob"):   # `none` has no ratio to check
        reinforce_zero_loss(torch.full((1, 1), float("-inf")), torch.zeros(1, 1), t([1.0]), torch.ones(1, 1),
                            correction="none")


def test_ppo_clip_hand():
    # one response, two tokens, ratio r = [1.5, 0.9], eps 0.2 -> clip(r) = [1.2, 0.9]
    lp = t([[L(.6), L(.45)]]).requires_grad_()
    old = t([[L(.4), L(.5)]])
    m = torch.ones(1, 2, dtype=F64)
    # A = +1: min(1.5, 1.2) = 1.2, min(0.9, 0.9) = 0.9 -> L = -(1.2 + 0.9) / 2 = -1.05
    loss, met = ppo_clip_loss(lp, old, t([1.0]), m)
    assert loss.item() == pytest.approx(-1.05)
    assert met["clip_fraction"] == 0.5 and met["rejection_rate"] == 0.5
    loss.backward()
    # token 0 is clipped (no gradient); token 1: d(r A)/dlp = r A = 0.9, times -(1/2) -> -0.45
    assert torch.allclose(lp.grad, t([[0.0, -0.45]]))
    # A = -1: min(-1.5, -1.2) = -1.5 (unclipped), -0.9 -> L = (1.5 + 0.9) / 2 = 1.2
    loss, met = ppo_clip_loss(lp, old, t([-1.0]), m)
    assert loss.item() == pytest.approx(1.2) and met["clip_fraction"] == 0.0
    # clip-higher: eps_high 0.28 -> clip(1.5) = 1.28 -> L = -(1.28 + 0.9) / 2 = -1.09
    loss, _ = ppo_clip_loss(lp, old, t([1.0]), m, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.09)
    with pytest.raises(NonFiniteRatioError):
        ppo_clip_loss(lp, t([[float("-inf"), 0.0]]), t([1.0]), m)


def test_ppo_equals_reinforce_on_policy():
    # at ratio 1 the PPO gradient is the REINFORCE gradient (d r / d lp = r = 1)
    lp_l, _, adv, m = loss_batch()
    l1, _ = ppo_clip_loss(lp_l, lp_l.detach(), adv, m)
    g1, = torch.autograd.grad(l1, lp_l)
    l2, _ = reinforce_zero_loss(lp_l, lp_l.detach(), adv, m)
    g2, = torch.autograd.grad(l2, lp_l)
    assert torch.allclose(g1, g2, atol=1e-12)


# ---------------------------------------------------------------- NeMo RL adapter

def nemo_batch(b=6, s=9, seed=0, drop_sample=2):
    """A NeMo-RL-shaped batch: prompt of 3 tokens, response of random length, padding after it."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(b, s, dtype=F64)
    for i in range(b):
        n = int(torch.randint(0, s - 3 + 1, (1,), generator=g))     # 0 .. s-3 response tokens
        token_mask[i, 3:3 + n] = 1
    sample_mask = torch.ones(b, dtype=F64)
    if drop_sample is not None and drop_sample < b:
        sample_mask[drop_sample] = 0
    lp = -torch.rand(b, s - 1, generator=g, dtype=F64) * 2
    gen = torch.cat([torch.zeros(b, 1, dtype=F64), lp + 0.05 * torch.randn(b, s - 1, generator=g, dtype=F64)], 1)
    adv_seq = torch.randn(b, generator=g, dtype=F64)
    data = {
        "input_ids": torch.randint(3, 40, (b, s), generator=g),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "generation_logprobs": gen,
        "prev_logprobs": torch.cat([torch.zeros(b, 1, dtype=F64), lp], 1),
        "advantages": adv_seq[:, None].expand(b, s).clone(),
    }
    return data, lp


def globals_of(data):
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    return data["sample_mask"].sum(), mask.sum()


def run_microbatches(fn, data, lp, mb, local=False):
    """Sum of losses / grads / metrics over microbatches of size mb (global normalisers unless local)."""
    gseq, gtok = globals_of(data)
    total, grads, mets = 0.0, [], []
    for start in range(0, lp.shape[0], mb):
        sl = slice(start, start + mb)
        d = {k: v[sl] for k, v in data.items()}
        if local:  # the broken variant: normalise each microbatch by its own counts
            gseq, gtok = globals_of(d)
        x = lp[sl].clone().requires_grad_()
        loss, met = fn(d, gseq, gtok, next_token_logprobs=x)
        loss.backward()
        total = total + loss.detach()
        grads.append(x.grad)
        mets.append(met)
    return total, torch.cat(grads), mets


def full_batch(fn, data, lp):
    gseq, gtok = globals_of(data)
    x = lp.clone().requires_grad_()
    loss, met = fn(data, gseq, gtok, next_token_logprobs=x)
    loss.backward()
    return loss.detach(), x.grad, met


@pytest.mark.parametrize("correction", CORRECTIONS)
@pytest.mark.parametrize("token_level", [False, True])
def test_microbatches_sum_to_full_batch(correction, token_level):
    params = {"lo": 0.9, "hi": 1.1} if correction == "seq_gate" else {}
    fn = ReinforceZeroLossFn(correction=correction, token_level_loss=token_level, **params)
    data, lp = nemo_batch()
    loss, grad, met = full_batch(fn, data, lp)
    for mb in (1, 2, 4):
        l2, g2, mets = run_microbatches(fn, data, lp, mb)
        assert torch.allclose(l2, loss, rtol=1e-12, atol=1e-14)
        assert torch.allclose(g2, grad, rtol=1e-12, atol=1e-14)
        for k in ("is_dev", "k1", "k3", "rejection_rate", "token_mult_prob_error", "num_valid_samples"):
            assert sum(x[k] for x in mets) == pytest.approx(met[k], rel=1e-10, abs=1e-14), k
        assert min(x["probs_ratio_min"] for x in mets) == met["probs_ratio_min"]
        assert max(x["probs_ratio_max"] for x in mets) == met["probs_ratio_max"]


def test_microbatch_negative_control_local_normalisation_fails():
    # the check can fail: normalising each microbatch by its own counts does not add up to the batch loss
    fn = ReinforceZeroLossFn()
    data, lp = nemo_batch()
    loss, grad, _ = full_batch(fn, data, lp)
    l2, g2, _ = run_microbatches(fn, data, lp, 2, local=True)
    assert not torch.allclose(l2, loss, rtol=1e-6) and not torch.allclose(g2, grad, rtol=1e-6)


def test_microbatches_float32():
    # the usual learner dtype: summation order differs between the two paths, so equal to fp32 rounding
    fn = ReinforceZeroLossFn()
    data, lp = nemo_batch(b=8, s=12, seed=5)
    data = {k: v.float() if v.is_floating_point() else v for k, v in data.items()}
    loss, grad, _ = full_batch(fn, data, lp.float())
    l2, g2, _ = run_microbatches(fn, data, lp.float(), 3)
    assert torch.allclose(l2, loss, rtol=1e-6, atol=1e-7) and torch.allclose(g2, grad, rtol=1e-6, atol=1e-8)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 7), st.integers(4, 10), st.integers(1, 7), st.integers(0, 2**31 - 1))
def test_microbatch_property(b, s, mb, seed):
    fn = ReinforceZeroLossFn()
    data, lp = nemo_batch(b, s, seed, drop_sample=seed % (b + 1))
    loss, grad, _ = full_batch(fn, data, lp)
    l2, g2, _ = run_microbatches(fn, data, lp, mb)
    assert torch.allclose(l2, loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(g2, grad, rtol=1e-12, atol=1e-14)


def test_adapter_matches_plain_loss_and_slices():
    # with every sample valid and [B] advantages, the adapter is reinforce_zero_loss on the [:, 1:] slices
    data, lp = nemo_batch(drop_sample=None)
    data["advantages"] = data["advantages"][:, 0].clone()
    fn = ReinforceZeroLossFn()
    gseq, gtok = globals_of(data)
    loss, met = fn(data=data, global_valid_seqs=gseq, global_valid_toks=gtok, next_token_logprobs=lp)
    ref, ref_met = reinforce_zero_loss(lp, data["generation_logprobs"][:, 1:], data["advantages"],
                                       data["token_mask"][:, 1:])
    assert torch.allclose(loss, ref, rtol=1e-12)
    assert met["is_dev"] == pytest.approx(ref_met["is_dev"]) and met["gen_kl_error"] == pytest.approx(ref_met["k3"])
    # newer NeMo RL call order (next_token_logprobs, data, seqs, toks) gives the same loss
    loss2, _ = fn(lp, data, gseq, gtok)
    assert torch.equal(loss, loss2)
    # ratio_source="prev" with prev == current gives the same loss
    loss3, _ = ReinforceZeroLossFn(ratio_source="prev")(data, gseq, gtok, next_token_logprobs=lp)
    assert torch.allclose(loss, loss3, rtol=1e-12)


def test_adapter_protocol_attributes_without_nemo_rl():
    fn = ReinforceZeroLossFn()
    assert fn.loss_type.value == "sequence_level" and fn.input_type.value == "logprob"
    assert ReinforceZeroLossFn(token_level_loss=True).loss_type.value == "token_level"
    assert fn.metric_normalizations["is_dev"].value == "tokens"
    assert fn.metric_normalizations["loss"].value == "sequences"
    assert "nemo_rl" not in sys.modules      # the adapter never imports NeMo RL itself


def test_adapter_uses_nemo_rl_enums_when_loaded(monkeypatch):
    # a stand-in nemo_rl: when it is loaded, the attributes are its own enum members (NeMo RL compares ==)
    class LossType(enum.Enum):
        TOKEN_LEVEL = "token_level"
        SEQUENCE_LEVEL = "sequence_level"

    class LossInputType(enum.Enum):
        LOGIT = "logit"
        LOGPROB = "logprob"

    iface = types.ModuleType("nemo_rl.algorithms.loss.interfaces")
    iface.LossType, iface.LossInputType = LossType, LossInputType
    for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.loss.interfaces", iface)
    fn = ReinforceZeroLossFn()
    assert fn.loss_type is LossType.SEQUENCE_LEVEL and fn.input_type is LossInputType.LOGPROB


def test_adapter_errors():
    data, lp = nemo_batch()
    gseq, gtok = globals_of(data)
    fn = ReinforceZeroLossFn()
    with pytest.raises(ValueError, match=r"must be \[B, S-1\]"):
        fn(data, gseq, gtok, next_token_logprobs=lp[:, :-1])
    with pytest.raises(ValueError, match="needs global_valid_seqs"):
        fn(data, None, gtok, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="needs next_token_logprobs.*got logits"):
        fn(data, gseq, gtok, logits=lp)
    d = dict(data)
    del d["generation_logprobs"]
    with pytest.raises(ValueError, match="lacks key.*generation_logprobs"):
        fn(d, gseq, gtok, next_token_logprobs=lp)
    d = dict(data, curr_logprobs_keep_mask=torch.zeros_like(lp))
    with pytest.raises(ValueError, match="top-k/top-p"):
        fn(d, gseq, gtok, next_token_logprobs=lp)
    with pytest.raises(ValueError, match="unknown parameter"):
        ReinforceZeroLossFn(correction="tis", clip=3)
    with pytest.raises(ValueError, match="unknown correction"):
        ReinforceZeroLossFn(correction="gspo")
    d = dict(data)
    d["generation_logprobs"] = data["generation_logprobs"].clone()
    d["generation_logprobs"][0, 4] = float("-inf")
    d["token_mask"] = data["token_mask"].clone()
    d["token_mask"][0, 4] = 1
    d["sample_mask"] = torch.ones_like(data["sample_mask"])
    with pytest.raises(NonFiniteRatioError, match=r"\(row 0, token 3\)"):   # token 4 of input_ids = 3 after [:, 1:]
        fn(d, *globals_of(d), next_token_logprobs=lp)
