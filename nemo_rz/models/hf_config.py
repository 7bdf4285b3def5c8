"""Hugging Face config.json <-> DecoderConfig, for the Qwen3 / Qwen2 / Llama families.

config_from_hf checks every key it reads (types, ranges, the architecture) and fills in transformers'
per-class defaults for keys a file may omit; hf_config writes the keys transformers needs to load the same model.
Every problem raises ModelFileError (a ValueError) with one line: what is wrong, in which file, what to do.
"""
from __future__ import annotations

import math

import torch

from nemo_rz.models.config import DTYPES, DecoderConfig

CONFIG_FILE = "config.json"

# architecture -> (model_type, qk_norm, q/k/v bias fixed by the architecture (None: read `attention_bias`))
ARCHITECTURES = {
    "Qwen3ForCausalLM": ("qwen3", True, None),
    "Qwen2ForCausalLM": ("qwen2", False, True),
    "LlamaForCausalLM": ("llama", False, None),
}
SUPPORTED = ", ".join(ARCHITECTURES)
_BY_MODEL_TYPE = {model_type: arch for arch, (model_type, _, _) in ARCHITECTURES.items()}
# transformers' per-class defaults for keys a config.json may omit
_DEFAULT_MAX_POSITIONS = {"qwen3": 32768, "qwen2": 32768, "llama": 2048}
_DEFAULT_MAX_WINDOW_LAYERS = 28


class ModelFileError(ValueError):
    """A model file or directory is missing, unreadable or does not fit: one line, what / where / what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def architecture_of(d: dict, source: str) -> str:
    archs = d.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ModelFileError(
                f"'architectures' in {source} is {archs!r}: expected a list like [\"Qwen3ForCausalLM\"]; fix config.json"
            )
        arch = archs[0]
    else:
        model_type = d.get("model_type")
        if model_type not in _BY_MODEL_TYPE:
            raise ModelFileError(
                f"{source} names no architecture ('architectures' missing, model_type={model_type!r}): "
                f"nemo_rz loads {SUPPORTED}; add \"architectures\": [\"<one of these>\"] to config.json"
            )
        arch = _BY_MODEL_TYPE[model_type]
    if arch not in ARCHITECTURES:
        raise ModelFileError(
            f"unsupported architecture {arch!r} in {source}: nemo_rz loads {SUPPORTED}; "
            "use a checkpoint of one of these families"
        )
    return arch


def _int(d: dict, key: str, source: str, default=None, required: bool = False) -> int | None:
    value = d.get(key)
    if value is None:
        if required:
            raise ModelFileError(f"{source} has no {key!r}: a Qwen3/Qwen2/Llama config needs it; fix config.json")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelFileError(f"{key!r} in {source} is {value!r}: expected a positive integer; fix config.json")
    return value


def _float(d: dict, key: str, source: str, default: float) -> float:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelFileError(f"{key!r} in {source} is {value!r}: expected a positive number; fix config.json")
    return float(value)


def _rope_theta(d: dict, source: str) -> float:
    """rope_theta wherever transformers puts it: rope_parameters (v5), rope_scaling (legacy) or the top level."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}  # transformers: rope_scaling wins
    where = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ModelFileError(f"{where!r} in {source} is {params!r}: expected an object or null; fix config.json")
    nested = [v for v in params.values() if isinstance(v, dict)]
    if nested:  # one entry per layer type
        if any(v != nested[0] for v in nested) or len(nested) != len(params):
            raise ModelFileError(
                f"{where!r} in {source} sets different RoPE per layer type: nemo_rz uses one RoPE for all layers; "
                "use a checkpoint with a single rope_parameters entry"
            )
        params = nested[0]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ModelFileError(
            f"RoPE scaling type {rope_type!r} in {source} ({where}) is not supported: nemo_rz implements plain RoPE "
            "only (rope_type 'default'); use a checkpoint without rope scaling"
        )
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if factor not in (None, 1, 1.0):
        raise ModelFileError(
            f"partial_rotary_factor={factor!r} in {source} is not supported: nemo_rz rotates the whole head; "
            "use a checkpoint with full rotary embeddings"
        )
    theta = params.get("rope_theta", d.get("rope_theta"))
    return _float({"rope_theta": theta}, "rope_theta", source, 10000.0)


def _sliding_window(d: dict, model_type: str, num_layers: int, source: str) -> int | None:
    if model_type == "llama" or not d.get("use_sliding_window"):
        return None
    window = _int(d, "sliding_window", source)
    if window is None:
        return None
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = d.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelFileError(
            f"'layer_types' in {source} is {layer_types!r}: expected one entry per layer ({num_layers}); fix config.json"
        )
    kinds = set(layer_types)
    if kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    raise ModelFileError(
        f"{source} mixes sliding-window and full-attention layers (layer_types / max_window_layers): nemo_rz's "
        "decoder uses one attention window for all layers; set use_sliding_window=false or max_window_layers=0"
    )


def config_from_hf(d: dict, source: str = CONFIG_FILE, dtype: str | torch.dtype | None = None) -> DecoderConfig:
    """DecoderConfig for a Hugging Face config.json dict (Qwen3 / Qwen2 / Llama causal LMs).

    `source` names the file in error messages; `dtype` overrides the checkpoint's dtype (float32 or bfloat16;
    a float16 or unknown checkpoint dtype loads as float32).
    """
    if not isinstance(d, dict):
        raise ModelFileError(f"{source} holds a {type(d).__name__}, not a JSON object; fix or re-download config.json")
    arch = architecture_of(d, source)
    model_type, qk_norm, fixed_bias = ARCHITECTURES[arch]
    if d.get("quantization_config"):
        raise ModelFileError(
            f"{source} describes a quantized checkpoint: nemo_rz loads unquantized float weights; "
            "use the float32/bfloat16 release of the model"
        )
    act = d.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelFileError(f"hidden_act={act!r} in {source} is not supported: nemo_rz's MLP is SwiGLU (silu)")
    if d.get("mlp_bias"):
        raise ModelFileError(f"mlp_bias=true in {source} is not supported: nemo_rz's MLP has no biases")
    attention_bias = fixed_bias if fixed_bias is not None else bool(d.get("attention_bias", False))
    if fixed_bias is None and attention_bias:
        raise ModelFileError(
            f"attention_bias=true in {source} is not supported for {arch}: it adds an o_proj bias, which nemo_rz's "
            "decoder does not have; use a checkpoint with attention_bias=false"
        )
    heads = _int(d, "num_attention_heads", source, required=True)
    hidden = _int(d, "hidden_size", source, required=True)
    layers = _int(d, "num_hidden_layers", source, required=True)
    # transformers: Qwen3Config.head_dim defaults to 128; Qwen2/Llama fall back to hidden_size // heads.
    head_dim = _int(d, "head_dim", source, 128 if model_type == "qwen3" else hidden // heads)
    kv_heads = _int(d, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ModelFileError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} in {source}; fix config.json"
        )
    if head_dim % 2:
        raise ModelFileError(f"head_dim={head_dim} in {source} is odd: RoPE needs an even head_dim; fix config.json")
    if dtype is None:
        saved = d.get("dtype", d.get("torch_dtype"))
        dtype = saved if saved in DTYPES else "float32"
    else:
        names = {v: k for k, v in DTYPES.items()}
        dtype = names.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: nemo_rz models run in {', '.join(DTYPES)}; pass one of these")
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ModelFileError(f"'tie_word_embeddings' in {source} is {tie!r}: expected true or false; fix config.json")
    try:
        return DecoderConfig(
            vocab_size=_int(d, "vocab_size", source, required=True),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size", source, required=True),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=_rope_theta(d, source),
            rms_norm_eps=_float(d, "rms_norm_eps", source, 1e-6),
            qk_norm=qk_norm,
            attention_bias=attention_bias,
            tie_word_embeddings=tie,
            max_position_embeddings=_int(d, "max_position_embeddings", source, _DEFAULT_MAX_POSITIONS[model_type]),
            sliding_window=_sliding_window(d, model_type, layers, source),
            dtype=dtype,
        )
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(f"{source}: {e}") from None


def hf_config(cfg: DecoderConfig, architecture: str = "Qwen3ForCausalLM") -> dict:
    """The config.json dict transformers needs to load a Decoder with `cfg` as `architecture`."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}: nemo_rz writes {SUPPORTED}")
    model_type, qk_norm, fixed_bias = ARCHITECTURES[architecture]
    fits = [
        arch for arch, (_, norm, bias) in ARCHITECTURES.items()
        if norm == cfg.qk_norm and (bias if bias is not None else False) == cfg.attention_bias
        and not (arch == "LlamaForCausalLM" and cfg.sliding_window)
    ]
    if architecture not in fits:
        hint = f"save it as {' or '.join(fits)}" if fits else "no supported architecture has this combination"
        raise ValueError(
            f"cannot save as {architecture}: the model has qk_norm={cfg.qk_norm}, attention_bias={cfg.attention_bias}, "
            f"sliding_window={cfg.sliding_window}, which {architecture} cannot express; {hint}"
        )
    theta = float(cfg.rope_theta)
    out = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": theta,  # transformers 4.x reads this ...
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},  # ... and 5.x this
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "dtype": cfg.dtype,
    }
    if model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        sliding = cfg.sliding_window is not None
        out.update(
            use_sliding_window=sliding,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if sliding else cfg.num_layers,
            layer_types=["sliding_attention" if sliding else "full_attention"] * cfg.num_layers,
        )
        if model_type == "qwen3":
            out["attention_bias"] = False
    return out
