"""nemo-rz's mismatch metrics under the names other RL frameworks log them, so a dashboard built for slime, verl or
NeMo RL reads a nemo-rz run (docs/metrics.md has the table).

Each peer key is one of nemo-rz's own keys of the same update (nemo_rz.metrics.mismatch_metrics of the learner's
logprobs at the update's weights against the rollout's, the comparison these frameworks log too), so the two
always hold the same value; `MetricsLog.write` adds them to every record that has the source key, and every
back-end (metrics.jsonl, TensorBoard, W&B, MLflow) receives them. Definitions were read from the frameworks'
sources: slime's `slime/backends/megatron_utils/loss.py` (reported as `train/<name>`), verl's
`verl/trainer/ppo/rollout_corr_helper.py` (compute_offpolicy_metrics, prefixed `rollout_corr/`) and NeMo RL's
`nemo_rl/algorithms/loss_functions.py` (ClippedPGLossFn's metrics, logged as `train/<name>`).
"""
from __future__ import annotations

# peer key: (nemo-rz's key, framework, the framework's definition with d = lp_learner - lp_rollout per valid token)
PEER_KEYS = {
    "train/train_rollout_logprob_abs_diff": ("abs_diff_seq_mean", "slime", "per-sample mean of |d|, averaged over samples"),
    "rollout_corr/kl": ("k1", "verl", "token mean of -d: KL(rollout || learner), direct estimator"),
    "rollout_corr/k3_kl": ("k3", "verl", "token mean of exp(d) - d - 1"),
    "rollout_corr/chi2_token": ("chi2", "verl", "token mean of exp(d)^2, minus 1"),
    "train/token_mult_prob_error": ("token_mult_prob_error", "NeMo RL", "token mean of exp(|d|)"),
    "train/gen_kl_error": ("k3", "NeMo RL", "token mean of exp(d) - d - 1"),
}
# nemo-rz's own keys the peers' names need in a record (beside k1 and k3, which every update logs)
OWN_KEYS = ("abs_diff_seq_mean", "chi2", "token_mult_prob_error")


def peer_names(record: dict) -> dict:
    """The peer keys of a metrics record: each with its source key's value, where the record has the source."""
    return {peer: record[own] for peer, (own, _, _) in PEER_KEYS.items() if own in record}
