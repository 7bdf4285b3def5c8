"""Rollout throughput: generated tokens/s of the built-in RolloutEngine (consistent vs fast kernels) and of
transformers' `generate`, on the same tiny Qwen3 model and the same batches.

The model is a transformers `Qwen3ForCausalLM` with random init, saved with `save_pretrained` to a temporary
directory and loaded into nemo-rz with `nemo_rz.models.hf.load_hf`, so every variant runs identical weights.
Prompts have a fixed length; every variant samples at temperature 1 over the full vocabulary (transformers:
do_sample=True, top_k=0, top_p=1, min_new_tokens=max_new_tokens) and generates exactly max_new_tokens per
prompt; only generated tokens are counted. Variants are interleaved (order rotated every repetition) so that
noise from other tenants hits them alike; the tables give the median over repetitions, and ratios are the
median of per-repetition ratios. Each run is timed twice: wall-clock, and the process's CPU time (torch runs
single-threaded by default here, so CPU time is the work done, less sensitive to time lost waiting for a
core that a neighbour holds).

Run with the glibc settings from ANCHORS.md (page faults are expensive on these VMs):

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
        python benchmarks/rollout_throughput.py
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
import warnings

import torch

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.models.hf import load_hf

VARIANTS = ("consistent", "fast", "transformers")


def build_models(args, directory: str):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(args.seed)
    hf = transformers.Qwen3ForCausalLM(config).float().eval()
    hf.save_pretrained(directory)
    ours = load_hf(directory)
    gen = hf.generation_config
    gen.do_sample, gen.temperature, gen.top_k, gen.top_p = True, 1.0, 0, 1.0
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = None, 0, None
    return hf, ours


def run_engine(engine: RolloutEngine, prompts: list[list[int]], new_tokens: int, seed: int, mode: str) -> tuple[int, float, float]:
    """(generated tokens, wall seconds, process CPU seconds) of one generate call."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    with ops.mode(mode):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert all(len(c.token_ids) == new_tokens for c in outs)
    return sum(len(c.token_ids) for c in outs), dt, dc


def run_transformers(hf, prompts: torch.Tensor, new_tokens: int, seed: int) -> tuple[int, float, float]:
    torch.manual_seed(seed)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0, c0 = time.perf_counter(), time.process_time()
        out = hf.generate(
            prompts, attention_mask=torch.ones_like(prompts), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        )
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    generated = out.shape[1] - prompts.shape[1]
    assert generated == new_tokens, generated
    return out.shape[0] * generated, dt, dc


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per variant and batch size (median)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    import transformers

    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  host {platform.node()}  "
          f"cpu {cpu_name()} x{os.cpu_count()}")
    print(f"torch {torch.__version__} (threads {torch.get_num_threads()}, interop {torch.get_num_interop_threads()})  "
          f"transformers {transformers.__version__}")
    print("malloc env: " + " ".join(f"{k}={os.environ.get(k, '-')}" for k in
                                    ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")))
    with tempfile.TemporaryDirectory() as d:
        hf, ours = build_models(args, d)
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"model: Qwen3ForCausalLM random init, vocab {args.vocab}, hidden {args.hidden}, intermediate "
          f"{args.intermediate}, layers {args.layers}, heads {args.heads}/{args.kv_heads} kv, head_dim "
          f"{args.hidden // args.heads}, {n_params / 1e6:.3f}M params, float32")
    print(f"prompt_len {args.prompt_len}, max_new_tokens {args.max_new_tokens}, temperature 1, reps {args.reps}")
    probe = torch.randint(0, args.vocab, (2, args.prompt_len), generator=torch.Generator().manual_seed(args.seed + 1))
    with torch.no_grad(), ops.mode("fast"):
        diff = (hf(probe).logits.float() - ours(probe)).abs().max().item()
    print(f"same weights: max |logits(transformers) - logits(nemo-rz, fast)| = {diff:.2e}")

    g = torch.Generator().manual_seed(args.seed)
    prompts = {b: torch.randint(0, args.vocab, (b, args.prompt_len), generator=g) for b in args.batch_sizes}
    max_len = args.prompt_len + args.max_new_tokens
    engines = {(b, v): RolloutEngine(ours, max_batch_size=b, max_model_len=max_len)
               for b in args.batch_sizes for v in args.variants if v != "transformers"}

    def once(b: int, v: str, seed: int) -> tuple[int, float, float]:
        if v == "transformers":
            return run_transformers(hf, prompts[b], args.max_new_tokens, seed)
        return run_engine(engines[b, v], prompts[b].tolist(), args.max_new_tokens, seed, v)

    for b in args.batch_sizes:  # warm-up: caches, allocator, lazy init
        for v in args.variants:
            once(b, v, 0)
    wall = {(b, v): [] for b in args.batch_sizes for v in args.variants}
    cpu = {(b, v): [] for b in args.batch_sizes for v in args.variants}
    for rep in range(args.reps):
        for b in args.batch_sizes:
            k = rep % len(args.variants)
            for v in args.variants[k:] + args.variants[:k]:
                tokens, dt, dc = once(b, v, 1000 + rep)
                wall[b, v].append(tokens / dt)
                cpu[b, v].append(tokens / dc)
        print(f"rep {rep + 1}/{args.reps} done", flush=True)

    ratios = [(n, d) for n, d in (("consistent", "fast"), ("consistent", "transformers"), ("fast", "transformers"))
              if n in args.variants and d in args.variants]
    results = {}
    for clock, rates in (("wall-clock", wall), ("process CPU time", cpu)):
        def paired(b, num, den):
            return statistics.median(x / y for x, y in zip(rates[b, num], rates[b, den]))

        print(f"\n{clock}: generated tokens/s (median over reps) and ratios (median of per-rep paired ratios)")
        print("| batch | " + " | ".join(f"{v} tok/s" for v in args.variants) + "".join(f" | {n}/{d}" for n, d in ratios) + " |")
        print("|" + "---|" * (1 + len(args.variants) + len(ratios)))
        for b in args.batch_sizes:
            row = f"| {b} | " + " | ".join(f"{statistics.median(rates[b, v]):,.0f}" for v in args.variants)
            row += "".join(f" | {paired(b, n, d):.2f}x" for n, d in ratios) + " |"
            print(row)
        results[clock] = {(b, n, d): paired(b, n, d) for b in args.batch_sizes for n, d in ratios}
    print()
    for clock, r in results.items():
        if {"consistent", "fast"} <= set(args.variants):
            worst = min(r[b, "consistent", "fast"] for b in args.batch_sizes)
            print(f"[{clock}] target consistent >= 0.9x fast at every batch size: "
                  f"{'MET' if worst >= 0.9 else 'MISSED'} (worst {worst:.2f}x)")
        if 32 in args.batch_sizes and "transformers" in args.variants:
            for v in ("consistent", "fast"):
                if v in args.variants:
                    x = r[32, v, "transformers"]
                    print(f"[{clock}] target engine ({v}) >= 2x transformers at batch 32: {'MET' if x >= 2 else 'MISSED'} ({x:.2f}x)")


if __name__ == "__main__":
    main()
