"""Gated DeltaNet (or, with --kind kda, Kimi Delta Attention: models/linear_attention.py) against its
full-attention twin, side by side in one run:

- learner: forward + backward of token_logprobs over one sequence of --length tokens (default 2048), the hybrid
  (linear layers as configured) vs the same model with every layer full attention; the ratio is the figure;
- decode: built-in engine tokens/s at small batch, consistent vs fast kernels;
- memory: the linear layers' state bytes per sequence vs a full-attention KV cache of --length tokens.

python benchmarks/linear_attention.py [--length 2048] [--repeats 3] [--batch 4] [--kind gated_deltanet|kda]
"""
from __future__ import annotations

import argparse
import time

import torch

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models import Decoder, DecoderConfig


def _cfg(linear: bool, kind: str = "gated_deltanet") -> DecoderConfig:
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    return DecoderConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                         head_dim=32, layer_types=types if linear else ["full_attention"] * 4, linear_kind=kind,
                         linear_num_key_heads=4 if kind == "kda" else 2, linear_num_value_heads=4, linear_key_head_dim=32,
                         linear_value_head_dim=32, norm="gemma", attention_output_gate=True, partial_rotary_factor=0.5,
                         max_position_embeddings=4096)


def _learner(model: Decoder, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    t = time.perf_counter()
    model.token_logprobs(ids).sum().backward()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--kind", choices=("gated_deltanet", "kda"), default="gated_deltanet")
    args = ap.parse_args()
    torch.manual_seed(0)
    hybrid, twin = Decoder(_cfg(True, args.kind)), Decoder(_cfg(False))
    ids = torch.randint(0, 256, (1, args.length))
    _learner(hybrid, ids[:, :128]), _learner(twin, ids[:, :128])  # warm-up
    pairs = [(_learner(hybrid, ids), _learner(twin, ids)) for _ in range(args.repeats)]
    ratios = sorted(h / f for h, f in pairs)
    print(f"learner fwd+bwd, {args.length} tokens: hybrid {min(h for h, _ in pairs):.2f} s, full-attention twin "
          f"{min(f for _, f in pairs):.2f} s, paired ratio median {ratios[len(ratios) // 2]:.2f}x")

    hybrid.eval()
    prompts = [torch.randint(0, 256, (100,)).tolist() for _ in range(args.batch)]
    rates = {}
    for mode in ("consistent", "fast"):
        with ops.use_kernels(mode), torch.no_grad():
            engine = RolloutEngine(hybrid, max_batch_size=args.batch, max_model_len=256)
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=2, seed=0))
            t = time.perf_counter()
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=32, seed=0))
            rates[mode] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
    print(f"decode at batch {args.batch}: consistent {rates['consistent']:.1f} tok/s, fast {rates['fast']:.1f} tok/s "
          f"(ratio {rates['consistent'] / rates['fast']:.2f})")

    cache = hybrid.new_cache(1, args.length)
    state = sum(s.nbytes_per_sequence() for s in cache.linear.values())
    cfg = hybrid.config
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * args.length * torch.finfo(cfg.torch_dtype).bits // 8
    print(f"per sequence, per linear layer: state {state // len(cache.linear)} bytes (float32) vs a full-attention KV "
          f"cache of {args.length} tokens {kv} bytes ({kv / (state / len(cache.linear)):.1f}x)")


if __name__ == "__main__":
    main()
