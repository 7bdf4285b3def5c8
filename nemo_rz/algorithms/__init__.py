"""Advantages, importance-weight corrections, the REINFORCE Zero loss and its NeMo RL adapter.

Everything here needs only torch (nemo_rl is never imported by this package).
"""
from nemo_rz.algorithms.advantages import group_advantages
from nemo_rz.algorithms.corrections import CORRECTIONS, Correction, NonFiniteRatioError, correction_params, importance_weights
from nemo_rz.algorithms.loss import ppo_clip, ppo_clip_loss, reinforce_zero_loss, seq_mean_token_mean
from nemo_rz.algorithms.nemo_rl import LossInputType, LossType, ReinforceZeroLossFn

__all__ = [
    "CORRECTIONS", "Correction", "LossInputType", "LossType", "NonFiniteRatioError", "ReinforceZeroLossFn",
    "correction_params", "group_advantages", "importance_weights", "ppo_clip", "ppo_clip_loss", "reinforce_zero_loss",
    "seq_mean_token_mean",
]
