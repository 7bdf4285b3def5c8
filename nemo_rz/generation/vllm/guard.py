"""`ConsistentRequests`: a vLLM logits processor that admits only requests whose sampling keeps the recorded
logprobs the distribution the token was drawn from.

nemo-rz's model returns float32 log_softmax(logits / T) at the engine-wide temperature T, and vLLM
(logprobs_mode="raw_logits") records those values verbatim. Anything vLLM applies after that (a request
temperature other than 1, top-k / top-p / min-p, penalties, logit bias, allowed / bad words, a minimum length that
masks the stop tokens, structured output, watermarking) changes the distribution the token is sampled from but not
the recorded logprobs, so the learner's logprobs would describe another distribution. vLLM calls `validate_params`
on every request at admission; a refusal is one line, and vLLM's OpenAI server answers it with HTTP 400.
`python -m nemo_rz.tools.serve` installs it (`logits_processors=[settings.GUARD]`). It never changes the logits.
"""
from __future__ import annotations

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import LogitsProcessor

# each sampling option and the values that leave the distribution alone
NEUTRAL = {
    "temperature": (0.0, 1.0),  # 0: greedy (the argmax); 1: the model's distribution at the engine's temperature
    "top_k": (None, 0, -1),
    "top_p": (None, 1.0),
    "min_p": (None, 0.0),
    "presence_penalty": (None, 0.0),
    "frequency_penalty": (None, 0.0),
    "repetition_penalty": (None, 1.0),
    "min_tokens": (None, 0),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "watermarking": (None, False),
}


class ConsistentRequests(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams):
        for key, neutral in NEUTRAL.items():
            value = getattr(sampling_params, key, None)
            if value not in neutral:
                hint = (" (the server applies its temperature inside nemo-rz's model: request temperature 1, or 0 for "
                        "greedy; start the server with --temperature T to sample at T)" if key == "temperature" else
                        "; sample from the model's full distribution")
                raise ValueError(f"nemo-rz's consistent model: {key}={value!r} is not supported: it changes the "
                                 f"distribution after the recorded logprobs are computed{hint}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True  # it changes nothing, so vLLM may skip it for greedy requests

    def update_state(self, batch_update) -> None:
        pass

