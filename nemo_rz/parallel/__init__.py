"""Parallel layouts over torch.distributed process groups (gloo on CPU): context parallel attention
(context.py), pipeline stages with a tap channel (pipeline.py). Import the submodules directly."""
