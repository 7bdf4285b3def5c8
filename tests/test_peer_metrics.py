"""Peers' metric names (runtime/peer_metrics.py): a run's metrics.jsonl holds nemo-rz's mismatch metrics also under
the keys slime, verl and NeMo RL log, with equal values, and each source follows the peer's definition.

The run is a 2-update tiny run whose rollouts use the fast kernels in bfloat16, so every mismatch metric is away
from its identity value (a consistent run logs 0 everywhere; test_loggers.py checks that every back-end holds the
same keys and values). Definitions are re-derived here from the peers' formulas on ragged batches; negative
controls: a token mean of |d| is not slime's per-sample mean, and the peer keys are not one number copied under
several names.
"""
import json
import math

import pytest
import torch

from nemo_rz import config
from nemo_rz.metrics import mismatch_metrics
from nemo_rz.runtime.peer_metrics import OWN_KEYS, PEER_KEYS, peer_names
from nemo_rz.runtime.trainer import Trainer


@pytest.fixture(scope="module")
def mismatched_rows(tmp_path_factory):
    run = tmp_path_factory.mktemp("peer_metrics") / "run"
    run.mkdir()
    cfg = config.load(None, [
        f"run_dir={run}", "task.name=add1", "warmup.steps=2", "algo.updates=2", "algo.prompts_per_update=2",
        "algo.group_size=2", "eval.n=4", "eval.every=0", "model.hidden_size=32", "model.intermediate_size=64",
        "progress=false", "metrics.tensorboard=false", "checkpoint.every=0",
        "runtime.rollout_kernels=fast", "runtime.rollout_dtype=bfloat16", "algo.correction=tis",
    ])
    Trainer(cfg, run, log=lambda *_: None).run()
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_metrics_jsonl_holds_the_peer_keys_with_equal_values(mismatched_rows):
    updates = [r for r in mismatched_rows if "k3" in r]
    assert len(updates) == 2
    for row in updates:
        for peer, (own, _, _) in PEER_KEYS.items():
            assert peer in row and row[peer] == row[own], (peer, own, row)
        assert all(math.isfinite(row[k]) for k in OWN_KEYS)
        assert row["k3"] > 0 and row["abs_diff_seq_mean"] > 0 and row["token_mult_prob_error"] > 1
    # negative control: the peer keys carry different quantities, not one value under several names
    row = updates[-1]
    assert len({row[p] for p in PEER_KEYS}) == len(PEER_KEYS) - 1  # gen_kl_error and k3_kl are both k3
    assert peer_names({"loss": 1.0}) == {}  # no source key, no peer key


def test_sources_follow_the_peers_definitions():
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(4, 9, generator=g, dtype=torch.float64) * 3
    learner = rollout + 0.2 * torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.zeros(4, 9)
    for i, n in enumerate([1, 9, 4, 6]):  # ragged sequences
        mask[i, :n] = 1
    m = mismatch_metrics(learner, rollout, mask)
    d, w = learner - rollout, mask.double()
    n = w.sum()
    # slime: sum_of_sample_mean(|old - rollout|) over the samples, reported per sample
    slime = ((d.abs() * w).sum(1) / w.sum(1)).mean()
    assert m["abs_diff_seq_mean"] == pytest.approx(slime.item(), rel=1e-12)
    # verl compute_offpolicy_metrics: kl = mean(rollout - old), k3_kl = mean(exp(r) - r - 1), chi2_token
    assert m["k1"] == pytest.approx(((-d) * w).sum().item() / n.item(), rel=1e-12)
    assert m["k3"] == pytest.approx(((d.exp() - d - 1) * w).sum().item() / n.item(), rel=1e-9)
    assert m["chi2"] == pytest.approx(((d.exp() ** 2) * w).sum().item() / n.item() - 1, rel=1e-9)
    # NeMo RL: token_mult_prob_error = mean(exp(|generation - prev|))
    assert m["token_mult_prob_error"] == pytest.approx(((d.abs().exp()) * w).sum().item() / n.item(), rel=1e-12)
    # negative control: the token mean of |d| (what a token-level average would give) is not slime's number
    token_mean = ((d.abs() * w).sum() / n).item()
    assert abs(token_mean - m["abs_diff_seq_mean"]) > 1e-3
