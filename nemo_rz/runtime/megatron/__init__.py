"""The Megatron-core learner (`runtime.learner=megatron`): a GPTModel from the same DecoderConfig, trained by
the same loss, with logprobs equal to the built-in Decoder's at every tensor-parallel size (consistent kernels).

Importing this package imports megatron-core (`pip install -e ".[megatron]"`).
"""
