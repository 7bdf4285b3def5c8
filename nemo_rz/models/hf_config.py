"""Hugging Face config.json <-> DecoderConfig, for the families nemo_rz loads: Qwen3, Qwen2, Llama, Mistral,
Qwen3-MoE, gpt-oss and Gemma 3 (text).

config_from_hf checks every key it reads (types, ranges, the architecture), fills in transformers' per-class
defaults for keys a file may omit, and refuses values nemo_rz does not implement; hf_config writes the keys
transformers needs to load the same model (and refuses a model the architecture cannot express, by reading its
own output back). Every problem raises ModelFileError (a ValueError) with one line: what is wrong, in which
file, what to do.
"""
from __future__ import annotations

import math

import torch

from nemo_rz.errors import ModelFileError
from nemo_rz.models.config import DTYPES, LAYER_TYPES, DecoderConfig
from nemo_rz.ops.rope import ROPE_TYPES

CONFIG_FILE = "config.json"


def _families():
    from nemo_rz.models import families  # the family modules import this module's readers

    return families


def __getattr__(name: str):
    """ARCHITECTURES ({architecture: Family}), SUPPORTED and Family, read from the family registry
    (nemo_rz.models.families) at each access, so families registered at run time are included."""
    if name == "ARCHITECTURES":
        return _families().TABLE
    if name == "SUPPORTED":
        return _families().supported()
    if name == "Family":
        from nemo_rz.models.families.base import Family

        return Family
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_DEFAULT_MAX_WINDOW_LAYERS = 28
# quantization_config.quant_method -> the recipe that keeps the release's values (nemo_rz.quant.checkpoints)
QUANTIZED_CHECKPOINTS = {"fp8": "fp8_block", "mxfp4": "mxfp4"}


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
        fam = _families().by_model_type(model_type) if isinstance(model_type, str) else None
        if fam is None:
            raise ModelFileError(
                f"{source} names no architecture ('architectures' missing, model_type={model_type!r}): "
                f"nemo_rz loads {_families().supported()}; add \"architectures\": [\"<one of these>\"] to config.json"
            )
        arch = fam.architecture
    if _families().by_architecture(arch) is None:
        raise ModelFileError(
            f"unsupported architecture {arch!r} in {source}: nemo_rz loads {_families().supported()}; "
            "use a checkpoint of one of these families"
        )
    return arch


# -- typed reads -------------------------------------------------------------------------------------------
def read_int(d: dict, key: str, source: str, default=None, required: bool = False, minimum: int = 1) -> int | None:
    value = d.get(key)
    if value is None:
        if required:
            raise ModelFileError(f"{source} has no {key!r}: the model needs it; fix config.json")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ModelFileError(f"{key!r} in {source} is {value!r}: expected {what}; fix config.json")
    return value


def read_float(d: dict, key: str, source: str, default: float | None) -> float | None:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelFileError(f"{key!r} in {source} is {value!r}: expected a positive number; fix config.json")
    return float(value)


def read_bool(d: dict, key: str, source: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelFileError(f"{key!r} in {source} is {value!r}: expected true or false; fix config.json")
    return value


def refuse_set(d: dict, source: str, key: str, why: str) -> None:
    if d.get(key) not in (None, False):
        raise ModelFileError(f"{key}={d[key]!r} in {source} is not supported: {why}; use a checkpoint without it")


# -- RoPE ----------------------------------------------------------------------------------------------------
_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
}


def _one_rope(p: dict, d: dict, source: str, where: str, default_theta: float,
              partial: bool = False) -> tuple[float, dict | None]:
    """(theta, rope_scaling dict or None) for one rope_parameters entry, as transformers reads it (partial: the
    family reads partial_rotary_factor itself)."""
    if not isinstance(p, dict):
        raise ModelFileError(f"{where!r} in {source} is {p!r}: expected an object; fix config.json")
    rope_type = p.get("rope_type", p.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ModelFileError(
            f"RoPE scaling type {rope_type!r} in {source} ({where}) is not supported: nemo_rz implements "
            f"{', '.join(ROPE_TYPES)}; use a checkpoint with one of these"
        )
    factor = p.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if factor not in (None, 1, 1.0) and not partial:
        raise ModelFileError(
            f"partial_rotary_factor={factor!r} in {source} is not supported: nemo_rz rotates the whole head; "
            "use a checkpoint with full rotary embeddings"
        )
    theta = read_float({"rope_theta": p.get("rope_theta", d.get("rope_theta"))}, "rope_theta", source, default_theta)
    if rope_type == "default":
        return theta, None
    scaling: dict = {"rope_type": rope_type}
    for key in _SCALING_KEYS[rope_type]:
        if p.get(key) is not None:
            scaling[key] = p[key]
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings wins, else max_position_embeddings
        original = d.get("original_max_position_embeddings") or p.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or d.get("max_position_embeddings")
    if rope_type == "yarn":
        if scaling.get("factor") is None and scaling["original_max_position_embeddings"]:
            scaling["factor"] = d.get("max_position_embeddings", 0) / scaling["original_max_position_embeddings"]
        for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
            scaling[key] = scaling.get(key) or default  # as transformers: 0 or null means the default
    try:
        from nemo_rz.ops.rope import RopeScaling

        RopeScaling(**scaling)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"RoPE parameters in {source} ({where}): {e}; fix config.json") from None
    return theta, scaling


def _rope(d: dict, source: str, fam, model_type: str) -> tuple[float, dict | None, float | None]:
    """(theta, scaling, sliding layers' theta or None) wherever transformers puts them: rope_parameters (v5),
    rope_scaling (legacy; it wins) or the top level, one entry or one per layer type."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    where = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if not isinstance(params, dict):
        raise ModelFileError(f"{where!r} in {source} is {params!r}: expected an object or null; fix config.json")
    nested = {k: v for k, v in params.items() if k in LAYER_TYPES}
    if not nested:
        theta, scaling = _one_rope(params, d, source, where, fam.theta, getattr(fam, "partial_rotary", False))
        if fam.local_theta is not None:  # legacy Gemma 3: the scaling is the full layers', rope_local_base_freq the rest
            return theta, scaling, read_float(d, "rope_local_base_freq", source, fam.local_theta)
        return theta, scaling, None
    if len(nested) != len(params):
        raise ModelFileError(
            f"{where!r} in {source} mixes per-layer-type entries with other keys; use one form; fix config.json"
        )
    local_default = fam.local_theta if fam.local_theta is not None else fam.theta
    theta, scaling = _one_rope(nested.get("full_attention") or {}, d, source, f"{where}.full_attention", fam.theta)
    local, local_scaling = _one_rope(nested.get("sliding_attention") or {}, d, source, f"{where}.sliding_attention", local_default)
    if local_scaling is not None:
        if (local, local_scaling) != (theta, scaling):
            raise ModelFileError(
                f"{where!r} in {source} scales the sliding layers' RoPE differently from the full layers': nemo_rz "
                "supports plain RoPE (its own theta) on sliding layers; use a checkpoint without it"
            )
        return theta, scaling, None
    return theta, scaling, local


# -- per-layer structure -------------------------------------------------------------------------------------
WINDOW_TYPES = ("full_attention", "sliding_attention")  # the layer types of the windowed families' configs


def _layer_types(d: dict, source: str, layers: int, default: list[str]) -> list[str]:
    types = d.get("layer_types")
    if types is None:
        return default
    if not isinstance(types, list) or len(types) != layers or any(t not in WINDOW_TYPES for t in types):
        raise ModelFileError(
            f"'layer_types' in {source} is {types!r}: expected one of {', '.join(WINDOW_TYPES)} per layer ({layers}); "
            "fix config.json"
        )
    return types


def _layer_windows(d: dict, source: str, fam, layers: int) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) in DecoderConfig's form (layer_types None when all layers are alike)."""
    full = ["full_attention"] * layers
    if fam.windows == "none":
        types = full
    elif fam.windows == "all":  # Mistral: every layer slides when sliding_window is set
        types = full if d.get("sliding_window") is None else ["sliding_attention"] * layers
    elif fam.windows == "all_if_used":  # Qwen3-MoE
        types = ["sliding_attention"] * layers if d.get("use_sliding_window") else full
    elif fam.windows == "qwen":  # Qwen2/Qwen3: layer_types, or the layers from max_window_layers on
        if not d.get("use_sliding_window") or d.get("sliding_window") is None:
            types = full
        else:
            first = read_int(d, "max_window_layers", source, _DEFAULT_MAX_WINDOW_LAYERS, minimum=0)
            types = _layer_types(d, source, layers, ["sliding_attention" if i >= first else "full_attention" for i in range(layers)])
    else:  # gpt-oss, Gemma 3: layer_types, or their default pattern
        pattern = fam.pattern(d, source)
        types = _layer_types(d, source, layers, ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)])
    if "sliding_attention" not in types:
        return None, None
    window = read_int(d, "sliding_window", source, fam.default_window)
    if window is None:
        raise ModelFileError(f"{source} has sliding-window layers but no 'sliding_window'; fix config.json")
    return window, None if all(t == "sliding_attention" for t in types) else types


def _moe(d: dict, source: str, fam, layers: int) -> dict:
    """The DecoderConfig mixture-of-experts keys of a MoE family's config (empty for dense families)."""
    found = fam.moe(d, source, layers)
    if found is None:
        return {}
    out, moe_layers = found
    if out["num_experts"] == 0 or not moe_layers:
        return dict(num_experts=0)
    if out["num_experts_per_tok"] > out["num_experts"]:
        raise ModelFileError(
            f"num_experts_per_tok={out['num_experts_per_tok']} in {source} is more than the {out['num_experts']} experts; "
            "fix config.json"
        )
    out["moe_layers"] = None if len(moe_layers) == layers else moe_layers
    return out


def _family_keys(d: dict, source: str, fam, arch: str) -> dict:
    """The DecoderConfig keys that only some families set (norm, activation, sinks, Gemma's scalars)."""
    if d.get("mlp_bias"):
        raise ModelFileError(f"mlp_bias=true in {source} is not supported: nemo_rz's MLP has no biases")
    return fam.family_keys(d, source)


def _dtype(d: dict, dtype) -> str:
    if dtype is None:
        saved = d.get("dtype", d.get("torch_dtype"))
        return saved if saved in DTYPES else "float32"
    names = {v: k for k, v in DTYPES.items()}
    dtype = names.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: nemo_rz models run in {', '.join(DTYPES)}; pass one of these")
    return dtype


def config_from_hf(d: dict, source: str = CONFIG_FILE, dtype: str | torch.dtype | None = None) -> DecoderConfig:
    """DecoderConfig for a Hugging Face config.json dict of a supported causal LM (SUPPORTED).

    `source` names the file in error messages; `dtype` overrides the checkpoint's dtype (float32 or bfloat16;
    a float16 or unknown checkpoint dtype loads as float32).
    """
    if not isinstance(d, dict):
        raise ModelFileError(f"{source} holds a {type(d).__name__}, not a JSON object; fix or re-download config.json")
    arch = architecture_of(d, source)
    fam = _families().by_architecture(arch)
    d = fam.normalized(d, source)
    quant = d.get("quantization_config")
    if quant and (not isinstance(quant, dict) or quant.get("quant_method") not in QUANTIZED_CHECKPOINTS):
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ModelFileError(
            f"{source} describes a quantized checkpoint (quant_method {method!r}): nemo_rz reads "
            f"{' and '.join(QUANTIZED_CHECKPOINTS)} checkpoints; use one of these or the float release of the model"
        )
    extra = _family_keys(d, source, fam, arch)
    biased = {"qkv": True, "none": False}.get(fam.bias, read_bool(d, "attention_bias", source, fam.bias_default))
    heads = read_int(d, "num_attention_heads", source, required=True)
    hidden = read_int(d, "hidden_size", source, required=True)
    layers = read_int(d, "num_hidden_layers", source, required=True)
    head_dim = read_int(d, "head_dim", source, fam.head_dim or hidden // heads)
    kv_heads = read_int(d, "num_key_value_heads", source, heads)
    if heads % kv_heads:
        raise ModelFileError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} in {source}; fix config.json"
        )
    if head_dim % 2:
        raise ModelFileError(f"head_dim={head_dim} in {source} is odd: RoPE needs an even head_dim; fix config.json")
    window, layer_types = _layer_windows(d, source, fam, layers)
    theta, scaling, local_theta = _rope(d, source, fam, fam.model_type)
    if window is None or local_theta == theta and scaling is None:
        local_theta = None  # no sliding layer, or they rotate as the full ones
    try:
        return DecoderConfig(**{**dict(
            vocab_size=read_int(d, "vocab_size", source, required=True),
            hidden_size=hidden,
            intermediate_size=read_int(d, "intermediate_size", source, required=True),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            rms_norm_eps=read_float(d, "rms_norm_eps", source, fam.rms_norm_eps),
            qk_norm=fam.qk_norm,
            attention_bias=biased,
            o_proj_bias=biased and fam.bias == "config",
            tie_word_embeddings=read_bool(d, "tie_word_embeddings", source, fam.tie),
            max_position_embeddings=read_int(d, "max_position_embeddings", source, fam.max_positions),
            sliding_window=window,
            layer_types=layer_types,
            dtype=_dtype(d, dtype),
            **_moe(d, source, fam, layers),
        ), **extra})  # a family's own keys win (multi-head latent attention sets num_kv_heads and head_dim)
    except ModelFileError:
        raise
    except ValueError as e:
        raise ModelFileError(f"{source}: {e}") from None


# -- writing -------------------------------------------------------------------------------------------------
def architecture_for(cfg: DecoderConfig) -> str:
    """The architecture a model with `cfg` is saved as by default (the family that claims it: families.for_config)."""
    return _families().for_config(cfg).architecture


def rope_entry(theta: float, scaling: dict | None) -> dict:
    return {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}


def _written(cfg: DecoderConfig, fam, arch: str) -> dict:
    theta = float(cfg.rope_theta)
    types = [("sliding_attention" if w is not None else "full_attention") for w in cfg.windows()]
    sliding = "sliding_attention" in types
    out = {
        "architectures": [arch],
        "model_type": fam.model_type,
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
        "rope_parameters": rope_entry(theta, cfg.rope_scaling),  # ... and 5.x this
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
    if fam.bias == "config":
        out["attention_bias"] = cfg.attention_bias
    fam.write(cfg, out, types, sliding)
    return out


def _structure(cfg: DecoderConfig) -> dict:
    """What a config means for the computation: equal structures are the same model."""
    d = cfg.to_dict()
    for key in ("layer_types", "sliding_window", "moe_layers", "rope_theta", "rope_scaling", "rope_local_theta", "dtype"):
        d.pop(key)
    d.update(windows=cfg.windows(), ropes=[cfg.rope(i) for i in range(cfg.num_layers)],
             linear=[cfg.is_linear(i) for i in range(cfg.num_layers)],
             moe=[cfg.is_moe(i) for i in range(cfg.num_layers)])
    if not cfg.num_experts:
        for key in ("num_experts_per_tok", "moe_intermediate_size", "moe_kind", "norm_topk_prob", "swiglu_limit",
                    "n_group", "topk_group", "routed_scaling_factor", "n_shared_experts", "shared_expert_intermediate_size"):
            d.pop(key)
    if cfg.query_pre_attn_scalar is None:
        d["query_pre_attn_scalar"] = float(cfg.head_dim)
    return d


def hf_config(cfg: DecoderConfig, architecture: str | None = None) -> dict:
    """The config.json dict transformers needs to load a Decoder with `cfg` as `architecture` (None: the
    natural one, architecture_for). Refuses (ValueError) a model the architecture cannot express."""
    architecture = architecture or architecture_for(cfg)
    fam = _families().by_architecture(architecture)
    if fam is None:
        raise ValueError(f"unsupported architecture {architecture!r}: nemo_rz writes {_families().supported()}")
    out = _written(cfg, fam, architecture)
    try:
        back = config_from_hf(out, "the written config", cfg.dtype)
    except ValueError as e:
        back, error = None, str(e)
    mine = _structure(cfg)
    if back is None or _structure(back) != mine:
        theirs = {} if back is None else _structure(back)
        differ = sorted(k for k in mine if mine.get(k) != theirs.get(k))
        fits = [a for a in _families().TABLE if a != architecture and _fits(cfg, a)]
        hint = f"save it as {' or '.join(fits)}" if fits else "no supported architecture has this combination"
        what = ", ".join(f"{k}={getattr(cfg, k, mine[k])!r}" for k in differ[:4]) if back is not None else error
        raise ValueError(f"cannot save as {architecture}: the model has {what}, which {architecture} cannot express; {hint}")
    return out


def _fits(cfg: DecoderConfig, architecture: str) -> bool:
    try:
        back = config_from_hf(_written(cfg, _families().by_architecture(architecture), architecture), "the written config", cfg.dtype)
    except ValueError:
        return False
    return _structure(back) == _structure(cfg)
