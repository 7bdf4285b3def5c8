"""nemo-rz: REINFORCE Zero for NeMo — asynchronous RL with bit-identical rollout and learner logprobs."""
__version__ = "0.1.0"
