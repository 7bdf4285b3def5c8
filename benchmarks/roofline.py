"""Roofline for this machine: peak float32 GEMM on one core and memory bandwidth, then how close each benchmark
row gets to the limit that binds it, consistent vs fast kernels, interleaved.

Limits: one-thread float32 GEMM GFLOP/s (the best of several large square `torch.mm` calls), and memory
bandwidth, stream-like: a copy of a 512 MiB buffer (above the 300 MB L3 here) (bytes read + bytes written, as STREAM counts them) and a
read of one (a sum), on 1 and 2 threads. Rows, on SmolLM2-135M (--model, default the checkpoint in models/, or
its shape with random weights: --preset smollm2-135m), all on 1 torch thread:

- learner: `token_logprobs` forward + backward on [batch, length] tokens: GFLOP/s against the peak;
- decode at batch 1, 8, 32 (the built-in RolloutEngine; a step's time is the difference of two generate calls
  with different budgets over the extra steps, so prefill cancels): bytes streamed per step (every weight once,
  the KV cache read) / step time against the one-thread bandwidth, and GFLOP/s against the peak;
- prefill: one generate call with a budget of one token (the prompts' forward, the last rows scored; no prefix
  cache, so every repetition computes its prompts);
- batch-1 linears: one token's linear layers alone (weights out of cache), C++ matrix-vector kernel vs the
  padded 2-row GEMM it replaces vs fast mode's `F.linear`, against a plain read of the same bytes interleaved
  with them (the bandwidth limit as it is at that moment).

`--attention-ab` adds the mode consistent-tiled to decode and prefill: consistent with ops.attention's C++ forward
turned off (the tiled ATen path it replaces, same bits), so the ratio consistent/consistent-tiled is that change.

Times are process CPU seconds (one thread: the work done, not time lost to other tenants); medians over
repetitions, variants interleaved with the order rotated every repetition.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/roofline.py
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402
from rollout_throughput import cpu_name  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402
from nemo_rz.kernels import cpu as cpu_kernels  # noqa: E402
from nemo_rz.ops import gemm  # noqa: E402

MODES = ("consistent", "fast")
TILED = "consistent-tiled"  # consistent, attention on the tiled ATen path (--attention-ab)
CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
MiB = 1 << 20


def cpu_seconds(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def wall_seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def peak_gflops(n: int, reps: int) -> float:
    """Best one-thread GFLOP/s of an [n, n] @ [n, n] float32 product."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)
    return 2 * n ** 3 / min(cpu_seconds(lambda: torch.mm(a, b, out=out)) for _ in range(reps)) / 1e9


def bandwidth(threads: int, reps: int, size: int = 512 * MiB) -> tuple[float, float]:
    """(copy GB/s counting read + write, read GB/s) on `threads` threads, best of reps (1 thread: process CPU
    time, as the rows; 2 threads: wall-clock, which needs an idle machine)."""
    src, dst = torch.ones(size // 4), torch.empty(size // 4)
    dst.copy_(src)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        clock = cpu_seconds if threads == 1 else wall_seconds
        copy = min(clock(lambda: dst.copy_(src)) for _ in range(reps))
        read = min(clock(lambda: src.sum()) for _ in range(reps))
    finally:
        torch.set_num_threads(saved)
    return 2 * size / copy / 1e9, size / read / 1e9


def model_counts(model) -> dict:
    """Float32 bytes of the linear weights one token streams (LM head included), and its multiply-adds."""
    c = model.config
    linears = [m.weight for name, m in model.named_modules() if hasattr(m, "weight") and m.weight is not None
               and m.weight.dim() == 2 and "embed" not in name]
    if model.lm_head is None:  # tied: the LM head reads the embedding matrix
        linears.append(model.model.embed_tokens.weight)
    macs = sum(w.numel() for w in linears)
    return dict(weight_bytes=4 * macs, macs=macs, kv_dim=c.num_kv_heads * c.head_dim, layers=c.num_layers,
                q_dim=c.num_heads * c.head_dim, linears=linears)


def attention_macs(counts: dict, queries: int, context: int) -> int:
    """Multiply-adds of scores and values for `queries` rows each attending to `context` positions, all layers."""
    return 2 * counts["layers"] * queries * context * counts["q_dim"]


@contextlib.contextmanager
def kernel_mode(mode: str):
    """ops.use_kernels(mode); TILED: consistent with ops.attention's C++ forward turned off."""
    with ops.use_kernels("consistent" if mode == TILED else mode):
        if mode != TILED:
            yield
            return
        attention = importlib.import_module("nemo_rz.ops.attention")
        saved, attention._cpp_applies = attention._cpp_applies, lambda *a: False
        try:
            yield
        finally:
            attention._cpp_applies = saved


def interleaved(variants: dict, reps: int) -> dict:
    """{name: [seconds...]}: each variant once per repetition, the order rotated every repetition."""
    names = list(variants)
    times = {n: [] for n in names}
    for rep in range(reps):
        k = rep % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(variants[n]())
    return times


def paired_ratio(times: dict, num: str, den: str) -> float:
    """Median of per-repetition speed ratios num/den (time den / time num)."""
    return statistics.median(d / n for n, d in zip(times[num], times[den]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes.add_arguments(ap, default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--learner-batch", type=int, nargs=2, default=[8, 64], metavar=("BATCH", "LENGTH"))
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, nargs=2, default=[4, 20], metavar=("SHORT", "LONG"),
                    help="the two decode budgets whose difference times the decode steps")
    ap.add_argument("--prefill", type=int, nargs=2, default=[8, 64], metavar=("BATCH", "LENGTH"))
    ap.add_argument("--attention-ab", action="store_true",
                    help=f"decode and prefill also in mode {TILED} (the C++ attention forward off)")
    args = ap.parse_args()
    gen_modes = MODES + (TILED,) * args.attention_ab
    if args.model is None and args.preset == "smollm2-135m" and CHECKPOINT.is_dir():
        args.model = str(CHECKPOINT)
    torch.set_num_threads(1)
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  cpu {cpu_name()}  torch {torch.__version__}  "
          f"C++ kernels {'built' if cpu_kernels.available() else 'unavailable'}")

    peak = peak_gflops(2048, args.reps)
    bw = {t: bandwidth(t, args.reps) for t in (1, 2)}
    print("\n| limit | value |\n|---|---|")
    print(f"| float32 GEMM peak, 1 thread (2048^3 torch.mm, best of {args.reps}, CPU time) | {peak:.0f} GFLOP/s |")
    for t, (copy, read) in bw.items():
        print(f"| copy bandwidth, {t} thread{'s' * (t > 1)} (512 MiB, read + write{', wall-clock' * (t > 1)}) | {copy:.1f} GB/s |")
        print(f"| read bandwidth, {t} thread{'s' * (t > 1)} (512 MiB sum{', wall-clock' * (t > 1)}) | {read:.1f} GB/s |")
    limit_bw = bw[1][0]

    model, _, desc = shapes.load(args)
    counts = model_counts(model)
    print(f"\nmodel {desc}; linear weights streamed per step {counts['weight_bytes'] / 1e6:.0f} MB")
    rows = []  # (row, mode, seconds, flops, bytes)

    # learner forward + backward
    b, length = args.learner_batch
    ids = torch.randint(0, model.config.vocab_size, (b, length), generator=torch.Generator().manual_seed(0))
    model.train()

    def learner(mode):
        with ops.use_kernels(mode):
            model.zero_grad(set_to_none=True)
            return cpu_seconds(lambda: model.token_logprobs(ids).sum().backward())

    for mode in MODES:
        learner(mode)
    times = interleaved({m: (lambda m=m: learner(m)) for m in MODES}, args.reps)
    tokens = b * length
    flops = 3 * 2 * (tokens * counts["macs"] + attention_macs(counts, tokens, length // 2))
    for m in MODES:
        rows.append((f"learner fwd+bwd [{b}x{length}]", m, statistics.median(times[m]), flops, None, tokens))
    ratios = {"learner": paired_ratio(times, "consistent", "fast")}
    model.eval()
    model.zero_grad(set_to_none=True)

    # decode
    g = torch.Generator().manual_seed(1)
    short, long = args.steps
    for batch in args.decode_batches:
        prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        engine = RolloutEngine(model, max_batch_size=batch, max_model_len=args.prompt_len + long + 1, prefix_cache_blocks=0)

        def gen(mode, budget, seed, prompts=prompts, engine=engine):
            params = [SamplingParams(max_new_tokens=budget, temperature=1.0, seed=seed + i) for i in range(len(prompts))]
            with kernel_mode(mode):
                return cpu_seconds(lambda: engine.generate(prompts, params))

        for m in gen_modes:
            gen(m, short, 0)
        times = interleaved({m: (lambda m=m: (gen(m, long, 7) - gen(m, short, 7)) / (long - short)) for m in gen_modes},
                            args.reps)
        context = args.prompt_len + (short + long) // 2
        kv_bytes = 2 * 4 * counts["layers"] * batch * context * counts["kv_dim"]
        flops = 2 * (batch * counts["macs"] + attention_macs(counts, batch, context))
        for m in gen_modes:
            rows.append((f"decode batch {batch}", m, statistics.median(times[m]), flops,
                         counts["weight_bytes"] + kv_bytes, batch))
        ratios[f"decode {batch}"] = paired_ratio(times, "consistent", "fast")
        if args.attention_ab:
            ratios[f"decode {batch} (vs {TILED})"] = paired_ratio(times, "consistent", TILED)

    # prefill
    pb, plen = args.prefill
    prompts = [torch.randint(0, model.config.vocab_size, (plen,), generator=g).tolist() for _ in range(pb)]
    engine = RolloutEngine(model, max_batch_size=pb, max_model_len=plen + 1, prefix_cache_blocks=0)  # no cached prompts

    def prefill(mode):
        params = SamplingParams(max_new_tokens=1, temperature=1.0, seed=3)
        with kernel_mode(mode):
            return cpu_seconds(lambda: engine.generate(prompts, params))

    for m in gen_modes:
        prefill(m)
    times = interleaved({m: (lambda m=m: prefill(m)) for m in gen_modes}, args.reps)
    lm_head = counts["linears"][-1].numel()
    flops = 2 * (pb * plen * (counts["macs"] - lm_head) + pb * lm_head + attention_macs(counts, pb * plen, plen // 2))
    for m in gen_modes:
        rows.append((f"prefill [{pb}x{plen}]", m, statistics.median(times[m]), flops, None, pb * plen))
    ratios["prefill"] = paired_ratio(times, "consistent", "fast")
    if args.attention_ab:
        ratios[f"prefill (vs {TILED})"] = paired_ratio(times, "consistent", TILED)

    # batch-1 linears alone
    linears = [gemm.weight_t(w, torch.float32) for w in counts["linears"]]  # the consistent route's [K, N] copies
    x = {w.shape[0]: torch.randn(1, w.shape[0]) for w in linears}
    routes = {w.shape: gemm.matmul_route(w.shape[0], w.shape[1], torch.float32, torch.device("cpu")) for w in linears}
    variants = {"padded 2-row GEMM": lambda: [gemm.routed_mm(x[w.shape[0]], w, routes[w.shape]) for w in linears],
                "fast F.linear": lambda: [F.linear(x[w.shape[1]], w) for w in counts["linears"]],
                "read the same bytes (sum)": lambda: [w.sum() for w in linears]}
    if cpu_kernels.available():
        variants = {"C++ matvec": lambda: [cpu_kernels.matvec(x[w.shape[0]], w) for w in linears], **variants}
    for fn in variants.values():
        fn()
    times = interleaved({n: (lambda fn=fn: cpu_seconds(fn)) for n, fn in variants.items()}, args.reps)

    print(f"\nprocess CPU time, 1 thread, medians of {args.reps} interleaved repetitions; bandwidth limit = 1-thread copy "
          f"{limit_bw:.1f} GB/s, compute limit = {peak:.0f} GFLOP/s")
    print("\n| row | mode | time per step | tokens/s | GFLOP/s | of peak | GB/s streamed | of bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    for row, mode, sec, flops, nbytes, tokens in rows:
        gf = flops / sec / 1e9
        gbs = f"{nbytes / sec / 1e9:.1f} | {nbytes / sec / 1e9 / limit_bw:.0%}" if nbytes else "- | -"
        print(f"| {row} | {mode} | {sec * 1e3:.1f} ms | {tokens / sec:,.0f} | {gf:.1f} | {gf / peak:.0%} | {gbs} |")
    print("\nconsistent/fast speed (consistent/consistent-tiled where named; median of paired per-repetition ratios): "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(f"\none token's linears alone ({len(linears)} weights, {counts['weight_bytes'] / 1e6:.0f} MB):")
    print("| kernel | ms | GB/s | of bandwidth | of the interleaved read |\n|---|---|---|---|---|")
    for n, ts in times.items():
        sec = statistics.median(ts)
        gbs = counts["weight_bytes"] / sec / 1e9
        print(f"| {n} | {sec * 1e3:.1f} | {gbs:.1f} | {gbs / limit_bw:.0%} | "
              f"{paired_ratio(times, n, 'read the same bytes (sum)'):.0%} |")


if __name__ == "__main__":
    main()
