"""Convert a GGUF file into a Hugging Face checkpoint directory that nemo-rz (and transformers) load directly.

    python -m nemo_rz.tools.convert MODEL.gguf OUT_DIR [--dtype float32|bfloat16]

OUT_DIR gets config.json and model.safetensors (the dequantized weights), the tokenizer files with the chat
template, tokenizer_config.json's add_bos_token set to the GGUF's BOS policy, and generation_config.json with
every EOS id. Loading the directory is faster than dequantizing the GGUF on every start. The directory is
written beside OUT_DIR and renamed into place when complete; an existing OUT_DIR is never touched.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from nemo_rz import atomic
from nemo_rz.errors import ArgumentParser
from nemo_rz.tools.common import fail


def hf_architecture(gguf_arch: str) -> str:
    """GGUF general.architecture -> the Hugging Face architecture written to config.json (the family registry's)."""
    from nemo_rz.models import families

    return families.by_gguf_arch(gguf_arch).architecture


def convert(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    from nemo_rz.models.gguf import check_file, load_gguf
    from nemo_rz.models.hf import save_hf
    from nemo_rz.tasks import HFTokenizer

    src, out = Path(gguf_file), Path(out_dir)
    if src.suffix.lower() != ".gguf":
        raise ValueError(f"{src}: not a .gguf file; pass the GGUF file to convert")
    if out.exists():
        raise ValueError(f"{out} already exists; choose a new output directory (nothing was written)")
    arch = hf_architecture(check_file(src))  # refuses other families and inconsistent sizes before the slow work
    tokenizer = HFTokenizer.from_pretrained(src)
    model = load_gguf(src, dtype)
    with atomic.new_dir(out) as ckpt:
        save_hf(model, ckpt, architecture=arch)
        tokenizer.tok.save_pretrained(str(ckpt))
        config_file = ckpt / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8"))
        config["add_bos_token"] = tokenizer.add_bos  # the GGUF's BOS policy, which transformers does not carry over
        config_file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": list(tokenizer.eos_ids), "pad_token_id": tokenizer.pad_id}
        (ckpt / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m nemo_rz.tools.convert", description=__doc__.split("\n")[0])
    ap.add_argument("gguf", help="the .gguf file (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE or Gemma 3 family)")
    ap.add_argument("out", help="the checkpoint directory to create")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    try:
        args = ap.parse_args(argv)
    except ValueError as e:
        fail(str(e))
    try:
        out = convert(args.gguf, args.out, args.dtype)
    except ValueError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {args.out}: {e.strerror or e}; check the path and free space")
    print(f"wrote {out}: train on it with python -m nemo_rz.train model.hf_path={out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
