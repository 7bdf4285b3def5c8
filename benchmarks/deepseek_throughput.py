"""A DeepSeek-V3-shaped model on the built-in engine: consistent vs fast tokens/s, mismatch, latent-cache memory.

A random ~50M-parameter Decoder of the DeepSeek-V3 architecture (multi-head latent attention with q_lora_rank,
interleaved YaRN RoPE; a dense first layer, then routed experts in groups with a shared expert) generates
--max-new-tokens tokens for each of B prompts at every batch size; per kernel set it prints generated tokens/s
(median of --reps) and the tokens whose rollout logprobs differ bitwise from the learner's. Then the KV cache's
bytes per token (the latent, kv_lora_rank + qk_rope_head_dim per layer) against a per-head cache of the same
model (heads * (qk_nope + qk_rope + v_head_dim) per layer).

With --engine vllm the same model runs inside vLLM (nemo-rz's model and latent paged cache, one in-process
engine whose kernel set is switched between the paired runs), and the cache line reports vLLM's own cache
tensors (one latent row per token and layer, no value half) against a per-head cache.

    python benchmarks/deepseek_throughput.py [--engine builtin|vllm] [--batch-sizes 8 32] [--max-new-tokens 32] [--reps 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.mla import cache_elements_per_token

SHAPE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=1,
             head_dim=32, qk_norm=False, attention_kind="mla", q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
             v_head_dim=32, rope_interleave=True, num_experts=12, num_experts_per_tok=2, moe_intermediate_size=256,
             moe_kind="deepseek", n_group=2, topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5,
             moe_layers=list(range(1, 8)), max_position_embeddings=1024,
             rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256, mscale=1.0,
                               mscale_all_dim=1.0))


def model(seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    m = Decoder(DecoderConfig(**SHAPE))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05)
    return m.eval()


def diff_tokens(m: Decoder, outs) -> tuple[int, int]:
    batch = pack(outs)
    with torch.no_grad():
        lp = m.token_logprobs(batch.input_ids, batch.lengths)
    valid = batch.mask.bool()
    return int((lp[valid] != batch.rollout_logprobs[valid]).sum()), int(valid.sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", choices=("builtin", "vllm"), default="builtin")
    args = ap.parse_args()
    if args.engine == "vllm":
        return main_vllm(args)
    torch.set_num_threads(args.threads)
    m = model()
    params = sum(p.numel() for p in m.parameters())
    print(f"model: {params / 1e6:.1f}M parameters, {SHAPE['num_layers']} layers, {SHAPE['num_experts']} routed experts "
          f"({SHAPE['n_group']} groups) + {SHAPE['n_shared_experts']} shared, threads={args.threads}")
    print("| batch | kernels | tokens/s (median) | differing tokens / generated |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for b in args.batch_sizes:
        prompts = [torch.randint(0, SHAPE["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(b)]
        sp = SamplingParams(max_new_tokens=args.max_new_tokens, seed=2)
        for mode in ("consistent", "fast"):
            with ops.use_kernels(mode):
                RolloutEngine(m, max_batch_size=b).generate(prompts[:2], SamplingParams(max_new_tokens=2, seed=2))  # warm
                rates, outs = [], None
                for _ in range(args.reps):
                    start = time.perf_counter()
                    outs = RolloutEngine(m, max_batch_size=b).generate(prompts, sp)
                    rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start))
                diff, total = diff_tokens(m, outs)
            print(f"| {b} | {mode} | {statistics.median(rates):.0f} | {diff} / {total} |", flush=True)
    latent, per_head = cache_elements_per_token(m.config)
    cache = m.new_cache(32, 256)
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in cache.k + cache.v}.values())
    per_head_bytes = 32 * cache.max_len * SHAPE["num_layers"] * per_head * 4
    print(f"KV cache per token and layer: {latent} values (latent) vs {per_head} (per-head keys and values): "
          f"{per_head / latent:.1f}x less; 32 sequences x {cache.max_len} positions: {held / 2**20:.1f} MiB held vs "
          f"{per_head_bytes / 2**20:.1f} MiB per-head")


def main_vllm(args) -> None:
    """Consistent vs fast tokens/s inside vLLM, paired per batch size (reps alternate the two sets), one engine."""
    from nemo_rz.generation.vllm import VLLMRolloutEngine
    from nemo_rz.generation.vllm.backend import kv_cache_bytes_per_token

    m = model()
    top = max(args.batch_sizes)
    print(f"engine: vLLM (in-process), threads={args.threads}")
    print("| batch | kernels | tokens/s (median) | differing tokens / generated |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    with VLLMRolloutEngine(m, kernels="consistent", multiprocess=False, max_batch_size=top,
                           max_model_len=args.prompt_len + args.max_new_tokens + 32) as engine:
        torch.set_num_threads(args.threads)
        for b in args.batch_sizes:
            prompts = [torch.randint(0, SHAPE["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(b)]
            sp = SamplingParams(max_new_tokens=args.max_new_tokens, seed=2)
            rates, outs = {"consistent": [], "fast": []}, {}
            for _ in range(args.reps + 1):  # the first round warms both sets up and is not counted
                for mode in rates:
                    engine.llm.collective_rpc("nemo_rz_set_kernels", args=(mode,))
                    engine.llm.reset_prefix_cache()
                    start = time.perf_counter()
                    outs[mode] = engine.generate(prompts, sp)
                    rates[mode].append(sum(len(o.token_ids) for o in outs[mode]) / (time.perf_counter() - start))
            for mode, r in rates.items():
                diff, total = diff_tokens(m, outs[mode])
                print(f"| {b} | {mode} | {statistics.median(r[1:]):.0f} | {diff} / {total} |", flush=True)
            print(f"paired ratio consistent/fast at batch {b}: "
                  f"{statistics.median(c / f for c, f in zip(rates['consistent'][1:], rates['fast'][1:])):.2f}")
        (info,) = engine.llm.collective_rpc("nemo_rz_info")
    latent, per_head = cache_elements_per_token(m.config)
    held = kv_cache_bytes_per_token(m.config)
    print(f"vLLM KV cache tensors: {info['kv_caches'][0]} per layer ([blocks, 1, block_size, latent]); "
          f"{held} bytes per token (all layers) vs {SHAPE['num_layers'] * per_head * 4} per-head "
          f"({per_head / latent:.1f}x less) and {SHAPE['num_layers'] * 2 * latent * 4} for a K+V cache of the latent width")


if __name__ == "__main__":
    main()
