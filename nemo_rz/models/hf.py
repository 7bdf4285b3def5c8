"""Hugging Face checkpoint I/O: Qwen3 / Qwen2 / Llama directories <-> Decoder (and .gguf files -> Decoder).

A checkpoint directory holds config.json plus model.safetensors (or model.safetensors.index.json and its
shards). Decoder's parameter names already follow the Hugging Face layout, so loading is a check (names,
shapes, finiteness) and a copy; no renaming.

Only json, safetensors and torch are used here: importing nemo_rz.models never imports transformers.

Every problem with a file raises ModelFileError (a ValueError) with one line: what is wrong, in which file,
what to do. save_hf writes into a temporary directory beside the target and swaps it in with a rename, so an
interrupted save never leaves a half-written checkpoint and never damages the one already there.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from nemo_rz import atomic
from nemo_rz.models.config import DTYPES, DecoderConfig
from nemo_rz.models.decoder import Decoder

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

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
_SAFETENSORS_FLOAT = {"F64", "F32", "F16", "BF16"}
_NAMES_SHOWN = 3


class ModelFileError(ValueError):
    """A model file or directory is missing, unreadable or does not fit: one line, what / where / what to do."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


# -- config ------------------------------------------------------------------------------------------------
def _architecture(d: dict, source: str) -> str:
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
    arch = _architecture(d, source)
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


# -- loading -----------------------------------------------------------------------------------------------
def _read_json(file: Path) -> object:
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as e:
        raise ModelFileError(f"cannot read {file}: {e.strerror or e}; check the file and its permissions") from None
    except UnicodeDecodeError:
        raise ModelFileError(f"{file} is not UTF-8 text; re-download or re-save the checkpoint") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelFileError(
            f"cannot parse {file}: {e.msg} at line {e.lineno} column {e.colno}; fix or re-download the file"
        ) from None


def _weight_files(root: Path) -> list[Path]:
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        return [single]
    if index.is_file():
        data = _read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelFileError(f"{index} has no valid 'weight_map' object; re-save or re-download the checkpoint")
        files = []
        for name in dict.fromkeys(weight_map.values()):
            shard = root / name
            if not shard.is_file():
                raise ModelFileError(
                    f"shard {name} listed in {index} is missing from {root}; re-download the checkpoint's weights"
                )
            files.append(shard)
        return files
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = (
        f"found only {', '.join(others[:_NAMES_SHOWN])} (PyTorch pickles, not read for safety): re-save with "
        "save_pretrained(path, safe_serialization=True)"
        if others else "save the weights with save_pretrained() or nemo_rz.models.save_hf()"
    )
    raise ModelFileError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {root}; {hint}")


def _names(items) -> str:
    items = list(items)
    more = f" (+{len(items) - _NAMES_SHOWN} more)" if len(items) > _NAMES_SHOWN else ""
    return ", ".join(items[:_NAMES_SHOWN]) + more


def _ignored(name: str, cfg: DecoderConfig) -> bool:
    # transformers ignores these too: RoPE buffers of old checkpoints, and the head of a tied model.
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_word_embeddings and name == "lm_head.weight")


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error types for bad headers / truncation
        raise ModelFileError(
            f"cannot read {file}: {e}; the file is corrupt or truncated, re-download or re-save it"
        ) from None


def _load_tensors(files: list[Path], model: Decoder, arch: str) -> dict[str, torch.Tensor]:
    cfg = model.config
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    where = files[0] if len(files) == 1 else f"{files[0].parent} ({len(files)} shards)"
    located: dict[str, Path] = {}
    bad_shape, bad_type = [], []
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                if _ignored(name, cfg) or name in located:
                    continue
                located[name] = file
                if name in expected:
                    sl = f.get_slice(name)
                    shape = tuple(sl.get_shape())
                    if shape != expected[name]:
                        bad_shape.append(f"{name} is {list(shape)} not {list(expected[name])}")
                    if sl.get_dtype() not in _SAFETENSORS_FLOAT:
                        bad_type.append(f"{name} ({sl.get_dtype()})")
    missing = [n for n in expected if n not in located]
    extra = [n for n in located if n not in expected]
    if missing:
        raise ModelFileError(
            f"{len(missing)} tensor(s) missing from {where}: {_names(missing)}; the weights do not match config.json "
            f"({arch}, {cfg.num_layers} layers) — re-save the checkpoint or fix config.json"
        )
    if extra:
        raise ModelFileError(
            f"{len(extra)} unexpected tensor(s) in {where}: {_names(extra)}; nemo_rz's {arch} decoder has no such "
            "parameters — check config.json matches the weights (layers, tie_word_embeddings, qk-norm, biases)"
        )
    if bad_shape:
        raise ModelFileError(
            f"{len(bad_shape)} tensor(s) with the wrong shape in {where}: {_names(bad_shape)}; config.json does "
            "not match the weights — fix config.json or re-save the checkpoint"
        )
    if bad_type:
        raise ModelFileError(
            f"{len(bad_type)} non-float tensor(s) in {where}: {_names(bad_type)}; nemo_rz loads float weights only"
        )
    out, nonfinite = {}, []
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                if located.get(name) != file or name not in expected:
                    continue
                t = f.get_tensor(name).to(cfg.torch_dtype).contiguous()
                if not bool(torch.isfinite(t).all()):
                    nonfinite.append(name)
                out[name] = t
    if nonfinite:
        raise ModelFileError(
            f"non-finite values (NaN/Inf) in {len(nonfinite)} tensor(s) in {where}: {_names(nonfinite)}; the "
            "checkpoint is corrupt or from a diverged run — use an earlier checkpoint"
        )
    return out


def load_hf(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> Decoder:
    """A Decoder (eval mode, on CPU) with the weights of a Hugging Face Qwen3 / Qwen2 / Llama checkpoint directory
    or a .gguf file of these families (dequantized through transformers: nemo_rz.models.gguf).

    dtype: "float32" / "bfloat16" (or the torch dtypes); None keeps the checkpoint's dtype when it is one of
    these and uses float32 otherwise.
    """
    from nemo_rz.models import gguf  # imports transformers only when a .gguf file is loaded

    if gguf.is_gguf(path):
        return gguf.load_gguf(path, dtype)
    root = Path(path)
    if not root.exists():
        raise ModelFileError(
            f"model directory {root} does not exist; pass the directory that holds config.json and model.safetensors"
        )
    if not root.is_dir():
        raise ModelFileError(f"{root} is a file, not a checkpoint directory or a .gguf file; pass the directory that holds it")
    config_file = root / CONFIG_FILE
    if not config_file.is_file():
        raise ModelFileError(
            f"no {CONFIG_FILE} in {root}: not a Hugging Face checkpoint directory; save the model with "
            "save_pretrained() or nemo_rz.models.save_hf()"
        )
    d = _read_json(config_file)
    cfg = config_from_hf(d, str(config_file), dtype)
    arch = _architecture(d, str(config_file))
    files = _weight_files(root)
    with torch.device("meta"):  # no throw-away random init; the loaded tensors become the parameters
        model = Decoder(cfg)
    state = _load_tensors(files, model, arch)
    model.load_state_dict(state, strict=True, assign=True)  # strict: every parameter replaced (Decoder has no buffers)
    return model.eval()


# -- saving ------------------------------------------------------------------------------------------------
_WEIGHT_NAMES = {CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE}


def _superseded(name: str) -> bool:
    """Files of the old checkpoint that the new weights replace (other files, e.g. the tokenizer, are kept)."""
    return name in _WEIGHT_NAMES or (name.startswith("model-") and name.endswith(".safetensors")) or (
        name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))
    )


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def save_hf(model: Decoder, path: str | os.PathLike, architecture: str = "Qwen3ForCausalLM") -> Path:
    """Write `model` as a Hugging Face checkpoint directory (config.json + model.safetensors) at `path`.

    The checkpoint is written to a temporary directory beside `path` and renamed into place, so a failure at
    any point leaves an existing checkpoint at `path` untouched. Other files in an existing directory (tokenizer,
    generation config...) are carried over; old weight files are replaced. Returns the path.
    """
    target = Path(path)
    if target.is_symlink():  # replace the directory the link points to, not the link
        target = target.resolve()
    config = hf_config(model.config, architecture)
    if target.exists() and not target.is_dir():
        raise ModelFileError(f"{target} exists and is a file; pass a directory path for the checkpoint")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    with atomic.new_dir(target) as tmp:
        if target.is_dir():
            for entry in target.iterdir():
                if _superseded(entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=_link_or_copy)
                elif entry.is_symlink():
                    os.symlink(os.readlink(entry), tmp / entry.name)
                else:
                    _link_or_copy(str(entry), str(tmp / entry.name))
        with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_FILE, 0o666 & ~atomic.umask())  # safetensors writes it private
        atomic.fsync(tmp / WEIGHTS_FILE)
    return target
