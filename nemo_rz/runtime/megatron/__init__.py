"""The Megatron-core learner (`runtime.learner=megatron`): a GPTModel from the same DecoderConfig, trained by
the same loss, with logprobs equal to the built-in Decoder's at every tensor-parallel size (consistent kernels).

model.py builds the model (layers.py: the nemo_rz.ops layer spec; moe.py: mixtures of experts and expert
parallelism; convert.py: weights to and from Hugging Face names), data_parallel.py and learner.py train it over
tp x pp x cp x dp processes (schedule.py: pipeline stages through Megatron's schedule; taps.py: the auxiliary
losses' taps, a co-trained draft's), launch.py starts those processes.
"""
import warnings

with warnings.catch_warnings():
    # megatron-core says at import that it falls back to torch without Transformer Engine or Apex: expected here.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).* not installed")
    try:
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
    except ImportError:
        raise ValueError('runtime.learner=megatron needs megatron-core: pip install -e ".[megatron]" '
                         "(or use runtime.learner=builtin)") from None
