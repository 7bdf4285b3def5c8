"""check_mismatch on one random checkpoint of each model family, consistent vs fast kernels.

Each family's checkpoint is written by transformers' own classes (random init, weights scaled up so the
distributions are peaky), loaded by nemo-rz, and run through `python -m nemo_rz.tools.check_mismatch` with
prompts longer than the sliding windows. Prints one table row per family and mode: tokens whose rollout and
learner logprobs differ bit for bit, out of those generated (prompts of 4-24 tokens, windows of 16).

    python benchmarks/families_mismatch.py [--batch-sizes 1 8 32] [--max-new-tokens 24]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

WINDOW = 16
COMMON = dict(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {  # name -> (transformers config class, its family-specific settings)
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                                                   num_experts_per_tok=2, mlp_only_layers=[0])),
    "GptOssForCausalLM": ("GptOssConfig", dict(intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                                               sliding_window=WINDOW)),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(intermediate_size=256, sliding_window=WINDOW, sliding_window_pattern=2,
                                                   query_pre_attn_scalar=32)),
    "MistralForCausalLM": ("MistralConfig", dict(intermediate_size=256, sliding_window=WINDOW)),
    "Qwen2ForCausalLM (max_window_layers)": ("Qwen2Config", dict(intermediate_size=256, use_sliding_window=True,
                                                                 sliding_window=WINDOW, max_window_layers=2)),
}


def write_checkpoint(config_cls: str, settings: dict, path: Path, seed: int = 0) -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_cls)(**COMMON, **settings),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.15)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    model.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args()
    print("| family | mode | differing tokens / generated |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for name, (config_cls, settings) in FAMILIES.items():
            path = Path(root) / config_cls
            write_checkpoint(config_cls, settings, path)
            for mode in ("consistent", "fast"):
                out = Path(root) / f"{config_cls}-{mode}.json"
                subprocess.run([sys.executable, "-m", "nemo_rz.tools.check_mismatch", "--model", str(path), "--kernels", mode,
                                "--batch-sizes", *map(str, args.batch_sizes), "--max-new-tokens", str(args.max_new_tokens),
                                "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
                rows = json.loads(out.read_text())["rows"]
                diff, total = sum(r["diff_tokens"] for r in rows), sum(r["tokens"] for r in rows)
                print(f"| {name} | {mode} | {diff} / {total} |", flush=True)


if __name__ == "__main__":
    main()
