"""Parallel layouts over torch.distributed process groups (gloo on CPU): rank-count-independent reductions
and tensor-parallel gathers (tensor.py), context parallel attention (context.py), pipeline stages with a tap
channel (pipeline.py). Import the submodules directly."""
