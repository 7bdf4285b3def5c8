"""GGUF files (llama.cpp's format) -> Decoder, dequantized to float by transformers' GGUF reader.

A GGUF file holds the weights (often quantized), the config and the tokenizer in one file. transformers reads
it with the `gguf` and `accelerate` packages (the `hf` extra); the dequantized state dict then goes through the
same config translation and checks as a checkpoint directory (nemo_rz.models.hf). The architecture is read
from the file's metadata first, so an unsupported model is refused before the (slow) dequantization.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from nemo_rz.extras import GGUF, require
from nemo_rz.models.decoder import Decoder
from nemo_rz.models.hf_config import ModelFileError, config_from_hf

# general.architecture values nemo_rz can run (Mistral GGUFs are written as "llama")
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def metadata(path: str | os.PathLike, keys: tuple[str, ...]) -> dict:
    """The values of `keys` (those present) in a GGUF file's metadata; the tensors are not read."""
    require(GGUF, f"reading {path}", "hf")
    import gguf

    file = Path(path)
    if not file.is_file():
        raise ModelFileError(f"GGUF file {file} does not exist; pass the path of a .gguf file or a checkpoint directory")
    try:
        reader = gguf.GGUFReader(str(file))
    except Exception as e:  # the reader raises ValueError/struct errors/... on a damaged file
        raise ModelFileError(f"cannot read {file} as GGUF ({type(e).__name__}: {e}); re-download the file") from None
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def check_architecture(path: str | os.PathLike) -> str:
    arch = metadata(path, ("general.architecture",)).get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"unsupported GGUF architecture {arch!r} in {path}: nemo_rz loads {', '.join(ARCHITECTURES)}; "
                             "use a GGUF of one of these families")
    return arch


def load_transformers(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """transformers' model for a GGUF file, dequantized to `dtype` and marked unquantized (so it can be saved)."""
    check_architecture(path)
    from transformers import AutoModelForCausalLM

    file = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name, dtype=dtype)
    model.hf_quantizer = None  # the weights are plain tensors now; save_pretrained refuses a "quantized" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_gguf(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> Decoder:
    """A Decoder (eval mode, CPU) with the dequantized weights of a Llama / Qwen2 / Qwen3 GGUF file."""
    hf = load_transformers(path)
    cfg = config_from_hf(hf.config.to_dict(), str(path), dtype)
    with torch.device("meta"):
        model = Decoder(cfg)
    expected = model.state_dict()
    state = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise ModelFileError(f"{path}: tensors do not match nemo_rz's decoder (missing {missing[:3]}, unexpected "
                             f"{extra[:3]}); this GGUF variant is not supported")
    bad = [k for k, v in state.items() if not bool(torch.isfinite(v).all())]
    if bad:
        raise ModelFileError(f"non-finite values (NaN/Inf) in {len(bad)} tensor(s) of {path}, e.g. {bad[0]}; "
                             "the file is corrupt, re-download it")
    model.load_state_dict({k: v.to(cfg.torch_dtype).contiguous() for k, v in state.items()}, strict=True, assign=True)
    return model.eval()
