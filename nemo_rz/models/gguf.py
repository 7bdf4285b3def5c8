"""GGUF files (llama.cpp's format) -> Decoder, read and dequantized with the `gguf` package (the `hf` extra).

A GGUF file holds the weights (often quantized), the config and the tokenizer in one file. The family comes
from general.architecture (nemo_rz.models.families: each family names its GGUF architecture, its tensor names
and what llama.cpp's converter changed in its tensors); the metadata becomes a config.json dict that goes
through the same config translation as a checkpoint directory (models/hf_config.py), and the tensors are mapped
to the Decoder's parameter names through the family's table. The metadata's sizes are checked against the
tensors' shapes first, so an inconsistent file is refused before anything is built or dequantized.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from nemo_rz.extras import GGUF, require
from nemo_rz.models import families
from nemo_rz.models.decoder import Decoder
from nemo_rz.models.families.base import gguf_names
from nemo_rz.models.hf_config import ModelFileError, config_from_hf
from nemo_rz.models.layers import laid_out_like

# general.architecture values nemo_rz can run (Mistral GGUFs are written as "llama"): the families' gguf_arch
ARCHITECTURES = families.gguf_architectures()


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def _reader(path: str | os.PathLike):
    require(GGUF, f"reading {path}", "hf")
    import gguf

    file = Path(path)
    if not file.is_file():
        raise ModelFileError(f"GGUF file {file} does not exist; pass the path of a .gguf file or a checkpoint directory")
    try:
        return gguf.GGUFReader(str(file))
    except Exception as e:  # the reader raises ValueError/struct errors/... on a damaged file
        raise ModelFileError(f"cannot read {file} as GGUF ({type(e).__name__}: {e}); re-download the file") from None


def metadata(path: str | os.PathLike, keys: tuple[str, ...]) -> dict:
    """The values of `keys` (those present) in a GGUF file's metadata; the tensors are not read."""
    reader = _reader(path)
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def _architecture(arch, path) -> str:
    if families.by_gguf_arch(arch) is None:
        raise ModelFileError(f"unsupported GGUF architecture {arch!r} in {path}: nemo_rz loads {', '.join(families.gguf_architectures())}; "
                             "use a GGUF of one of these families")
    return arch


def check_architecture(path: str | os.PathLike) -> str:
    return _architecture(metadata(path, ("general.architecture",)).get("general.architecture"), path)


_BLOCK = re.compile(r"^blk\.(\d+)\.")


def check_file(path: str | os.PathLike) -> str:
    """The file's architecture, after checking the sizes its metadata gives (block count, embedding and
    feed-forward lengths, head counts, vocabulary) against its tensors' names and shapes, without reading the
    weights: transformers builds the model from the metadata, so block_count = 100000000 would take hours to
    build before any tensor is compared."""
    reader = _reader(path)
    field = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    arch = _architecture(field("general.architecture"), path)
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}  # GGUF order: ne[0] (the row length) first

    def size(key: str, required: bool = True) -> int | None:
        value = field(f"{arch}.{key}")
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelFileError(f"metadata {arch}.{key} in {path} is {value!r}: expected a positive integer; "
                                 "the file is damaged or not a llama.cpp model, re-download it")
        return value

    def refuse(key: str, value, tensors: str) -> None:
        raise ModelFileError(f"metadata {arch}.{key}={value} in {path} does not match its tensors ({tensors}); the "
                             "file is damaged or inconsistent, re-download or re-convert it")

    blocks = size("block_count")
    found = {int(m.group(1)) for name in shapes if (m := _BLOCK.match(name))}
    held = max(found) + 1 if found else 0
    if blocks != held:
        refuse("block_count", blocks, f"blk.0 to blk.{held - 1}: {held} blocks" if held else "no blk.N tensors")
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ModelFileError(f"{path} has no 2-d token_embd.weight tensor; the file is damaged or not a llama.cpp model")
    hidden = size("embedding_length")
    if hidden != embed[0]:
        refuse("embedding_length", hidden, f"token_embd.weight rows of {embed[0]}")
    vocab = size("vocab_size", required=False)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens.data) if tokens is not None else None
    if vocab is not None and vocab != embed[1]:
        refuse("vocab_size", vocab, f"token_embd.weight has {embed[1]} token rows")
    if vocab is None and n_tokens is not None and n_tokens != embed[1]:
        raise ModelFileError(f"metadata tokenizer.ggml.tokens in {path} lists {n_tokens} tokens but token_embd.weight "
                             f"has {embed[1]} rows; the file is damaged or inconsistent, re-download or re-convert it")
    ffn = size("feed_forward_length")
    gate = shapes.get("blk.0.ffn_gate.weight") or shapes.get("blk.0.ffn_up.weight")
    if gate is not None and len(gate) == 2 and ffn != gate[1]:
        refuse("feed_forward_length", ffn, f"blk.0.ffn_gate.weight has {gate[1]} rows")
    heads, kv_heads = size("attention.head_count"), size("attention.head_count_kv", required=False)
    head_dim = size("attention.key_length", required=False) or hidden // heads
    for key, count, name in (("attention.head_count", heads, "attn_q"), ("attention.head_count_kv", kv_heads, "attn_k")):
        shape = shapes.get(f"blk.0.{name}.weight")
        if count is not None and shape is not None and len(shape) == 2 and count * head_dim != shape[1]:
            refuse(key, count, f"blk.0.{name}.weight has {shape[1]} rows, {shape[1] // max(head_dim, 1)} heads of {head_dim}")
    return arch


def load_transformers(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' model for a GGUF file, dequantized to `dtype` and marked unquantized (so it can be saved)."""
    check_file(path)
    from transformers import AutoModelForCausalLM

    file = Path(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=dtype)
    except Exception as e:  # transformers' own checks of the file (shapes, tensor types, ...)
        raise ModelFileError(f"cannot load {file} through transformers ({type(e).__name__}: {' '.join(str(e).split())[:300]}); "
                             "the file is damaged or a variant nemo_rz does not read") from None
    model.hf_quantizer = None  # the weights are plain tensors now; save_pretrained refuses a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def config_dict(reader, arch: str) -> dict:
    """The config.json dict (Hugging Face keys) that a GGUF file's metadata describes."""
    fam = families.by_gguf_arch(arch)
    field = lambda key: reader.fields[key].contents() if key in reader.fields else None  # noqa: E731
    get = lambda key: field(f"{arch}.{key}")  # noqa: E731
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
    d = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "vocab_size": get("vocab_size") or shapes["token_embd.weight"][1],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv") or heads,
        "head_dim": get("attention.key_length") or hidden // heads,
        "max_position_embeddings": get("context_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "sliding_window": get("attention.sliding_window"),
    }
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        d["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor"),
                             "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    d.update(fam.gguf_config(get, layers))
    return {k: v for k, v in d.items() if v is not None}


def _tensors(reader, fam, cfg, path) -> dict[str, torch.Tensor]:
    """The file's tensors under the Decoder's parameter names (float32), mapped through the family's table."""
    from gguf import GGMLQuantizationType, quants

    raw = {t.name: t for t in reader.tensors}
    names = gguf_names(fam, cfg.num_layers)
    used = set()

    def tensor(name: str) -> torch.Tensor:
        t = raw[name]
        used.add(name)
        shape = tuple(reversed([int(n) for n in t.shape]))  # GGUF lists ne[0] (the row length) first
        if t.tensor_type == GGMLQuantizationType.F32:
            values = t.data
        else:
            values = quants.dequantize(t.data, t.tensor_type)
        return torch.from_numpy(values.reshape(shape).copy()).float()

    out = {}
    for name, gg in names.items():
        parts = gg if isinstance(gg, tuple) else (gg,)
        if all(p in raw for p in parts):
            t = torch.cat([tensor(p) for p in parts], dim=-2) if len(parts) > 1 else tensor(parts[0])
            out[name] = fam.from_gguf(name, t, cfg)
    unused = sorted(set(raw) - used)
    if unused:
        raise ModelFileError(f"{len(unused)} tensor(s) of {path} that nemo_rz's {fam.architecture} decoder has no "
                             f"parameter for: {', '.join(unused[:3])}; this GGUF variant is not supported")
    return out


def load_gguf(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> Decoder:
    """A Decoder (eval mode, CPU) with the dequantized weights of a GGUF file of a family nemo_rz runs
    (ARCHITECTURES)."""
    arch = check_file(path)
    reader = _reader(path)
    fam = families.by_gguf_arch(arch)
    cfg = config_from_hf(config_dict(reader, arch), str(path), dtype)
    with torch.device("meta"):
        model = Decoder(cfg)
    expected = model.state_dict()
    state = _tensors(reader, fam, cfg, path)
    missing = sorted(set(expected) - set(state))
    bad_shape = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or bad_shape:
        raise ModelFileError(f"{path}: tensors do not match nemo_rz's decoder (missing {missing[:3]}, wrong shape "
                             f"{bad_shape[:3]}); this GGUF variant is not supported")
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelFileError(f"non-finite values (NaN/Inf) in {len(bad)} tensor(s) of {path}, e.g. {bad[0]}; "
                             "the file is corrupt, re-download it")
    # each tensor in its parameter's layout (a Linear weight's [K, N] storage, models/layers.py)
    state = {k: laid_out_like(v, expected[k], cfg.torch_dtype) if k in expected else v for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
