"""Rollout throughput: generated tokens/s of the built-in RolloutEngine (consistent vs fast kernels) and of
transformers' `generate`, on the same model and the same requests.

The model: a named shape or a real checkpoint (benchmarks/shapes.py: --preset tiny | smollm2-135m | qwen3-0.6b,
or --model PATH), the same weights in every variant. Every variant samples at temperature 1 over the full
vocabulary (transformers: do_sample=True, top_k=0, top_p=1). Workloads: `fixed` (every prompt prompt_len
tokens, every request max_new_tokens) and `mixed` (prompt lengths and budgets drawn per request between a
quarter and all of them: where continuous batching wins over a static batch, which runs to the longest budget).
Only each request's own budget counts as generated. Variants are interleaved (order rotated every repetition) so that
noise from other tenants hits them alike; the tables give the median over repetitions, and ratios are the
median of per-repetition ratios. Each run is timed twice: wall-clock, and the process's CPU time (torch runs
single-threaded by default here, so CPU time is the work done, less sensitive to time lost waiting for a
core that a neighbour holds).

Run with the glibc malloc settings from the README (page faults are expensive on these VMs):

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
        python benchmarks/rollout_throughput.py
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402

VARIANTS = ("consistent", "fast", "transformers")


def run_engine(engine: RolloutEngine, prompts: list[list[int]], budgets: list[int], seed: int, mode: str) -> tuple[int, float, float]:
    """(generated tokens, wall seconds, process CPU seconds) of one generate call; request i generates
    exactly budgets[i] tokens."""
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=seed + i) for i, n in enumerate(budgets)]
    with ops.use_kernels(mode):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompts, params)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert [len(c.token_ids) for c in outs] == budgets
    return sum(budgets), dt, dc


def run_transformers(hf, prompts: list[list[int]], budgets: list[int], seed: int) -> tuple[int, float, float]:
    """transformers `generate` on the same requests: one padded batch (left padding), run for the longest
    budget; only each request's own budget counts as generated (the rest is what a static batch wastes)."""
    torch.manual_seed(seed)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0, c0 = time.perf_counter(), time.process_time()
        out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                          max_new_tokens=max(budgets), min_new_tokens=max(budgets))
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert out.shape[1] - width == max(budgets)
    return sum(budgets), dt, dc


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
    ap.add_argument("--workload", choices=("fixed", "mixed"), default="fixed")
    shapes.add_arguments(ap)
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
    ours, hf, desc = shapes.load(args, args.seed, with_transformers="transformers" in args.variants)
    vocab = ours.config.vocab_size
    print(f"model: {desc}")
    print(f"workload {args.workload}, prompt_len {args.prompt_len}, max_new_tokens {args.max_new_tokens}, "
          f"temperature 1, reps {args.reps}")
    if hf is not None:
        probe = torch.randint(0, vocab, (2, args.prompt_len), generator=torch.Generator().manual_seed(args.seed + 1))
        with torch.no_grad(), ops.use_kernels("fast"):
            diff = (hf(probe).logits.float() - ours(probe)).abs().max().item()
        print(f"same weights: max |logits(transformers) - logits(nemo-rz, fast)| = {diff:.2e}")

    g = torch.Generator().manual_seed(args.seed)

    def lengths(b: int, most: int) -> list[int]:
        if args.workload == "fixed":
            return [most] * b
        return torch.randint(max(1, most // 4), most + 1, (b,), generator=g).tolist()

    prompts = {b: [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths(b, args.prompt_len)]
               for b in args.batch_sizes}
    budgets = {b: lengths(b, args.max_new_tokens) for b in args.batch_sizes}
    max_len = args.prompt_len + args.max_new_tokens
    engines = {(b, v): RolloutEngine(ours, max_batch_size=b, max_model_len=max_len)
               for b in args.batch_sizes for v in args.variants if v != "transformers"}

    def once(b: int, v: str, seed: int) -> tuple[int, float, float]:
        if v == "transformers":
            return run_transformers(hf, prompts[b], budgets[b], seed)
        return run_engine(engines[b, v], prompts[b], budgets[b], seed, v)

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
            for b in args.batch_sizes:  # targets: >= 0.9x at batch 8 and more, >= 0.7x at batch 1
                target = 0.7 if b == 1 else 0.9
                x = r[b, "consistent", "fast"]
                print(f"[{clock}] target consistent >= {target}x fast at batch {b}: {'MET' if x >= target else 'MISSED'} ({x:.2f}x)")
        if 32 in args.batch_sizes and "transformers" in args.variants:
            for v in ("consistent", "fast"):
                if v in args.variants:
                    x = r[32, v, "transformers"]
                    print(f"[{clock}] target engine ({v}) >= 1.5x transformers at batch 32: {'MET' if x >= 1.5 else 'MISSED'} ({x:.2f}x)")


if __name__ == "__main__":
    main()
