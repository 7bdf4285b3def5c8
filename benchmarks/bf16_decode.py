"""Consistent bfloat16 decode against float32 consistent and fast bfloat16, at batch 1, 8 and 32 (SmolLM2-135M).

Variants, each its own model loaded from the same checkpoint (load_hf with the dtype), in one process on one
torch thread:

- f32-consistent: float32 weights, consistent kernels (the C++ matrix-vector kernel at batch 1, MKL's GEMM route
  above);
- bf16-consistent: bfloat16 weights, float32 accumulation, consistent kernels: the weights are read as stored by
  the C++ rows_mm kernel (ops/gemm.py; no float32 copy);
- bf16-copy: the same, with rows_mm turned away (`gemm.rows_verified` answering no), so the weights take the
  route consistent bfloat16 took before: a float32 [K, N] copy per weight and MKL's GEMM on it;
- bf16-fast: bfloat16 weights and the library's own bfloat16 kernels (oneDNN; not batch-invariant);
- f32-fast: float32 weights, library kernels.

A decode step's time is the difference of two RolloutEngine.generate calls with budgets SHORT and LONG over the
extra steps (prefill cancels), in process CPU seconds; variants interleaved, the order rotated every repetition;
reported as medians and paired ratios (per repetition, then the median). Also the weight bytes each variant
holds (parameters plus kept copies).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/bf16_decode.py --model models/smollm2-135m-instruct --reps 3
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline import cpu_seconds, interleaved, paired_ratio  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402
from nemo_rz.kernels import cpu as cpu_kernels  # noqa: E402
from nemo_rz.models.hf import load_hf  # noqa: E402
from nemo_rz.ops import gemm  # noqa: E402
from nemo_rz.ops.weight_cache import ATTR  # noqa: E402

CHECKPOINT = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
VARIANTS = {  # name: (model dtype, kernel set, rows_mm allowed)
    "f32-consistent": ("float32", "consistent", True),
    "bf16-consistent": ("bfloat16", "consistent", True),
    "bf16-copy": ("bfloat16", "consistent", False),
    "bf16-fast": ("bfloat16", "fast", True),
    "f32-fast": ("float32", "fast", True),
}


@contextlib.contextmanager
def rows_mm_allowed(allowed: bool):
    real = gemm.rows_verified
    if not allowed:
        gemm.rows_verified = lambda *a, **k: False
    try:
        yield
    finally:
        gemm.rows_verified = real


def held_bytes(model) -> int:
    """Bytes of the parameters plus every derived copy kept on them (weight_cache)."""
    total = 0
    for p in model.parameters():
        total += p.numel() * p.element_size()
        for _, copy in p.__dict__.get(ATTR, {}).values():
            if isinstance(copy, torch.Tensor):
                total += copy.numel() * copy.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(CHECKPOINT), help="a Hugging Face checkpoint directory")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--steps", type=int, nargs=2, default=[4, 12], metavar=("SHORT", "LONG"))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}  "
          f"C++ kernels {'built' if cpu_kernels.available() else 'unavailable'}  load average {os.getloadavg()[0]:.1f}")
    models = {}
    for dtype in dict.fromkeys(VARIANTS[v][0] for v in args.variants):
        models[dtype] = load_hf(args.model, dtype=dtype).eval()
    if "bf16-copy" in args.variants:  # its own model: the copies it makes stay off the bf16-consistent one
        models["bf16-copy"] = load_hf(args.model, dtype="bfloat16").eval()
    model_of = {v: models["bf16-copy" if v == "bf16-copy" else VARIANTS[v][0]] for v in args.variants}
    vocab = next(iter(models.values())).config.vocab_size
    short, long = args.steps
    g = torch.Generator().manual_seed(1)
    results = {}
    for batch in args.batches:
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
        engines = {v: RolloutEngine(model_of[v], max_batch_size=batch, max_model_len=args.prompt_len + long + 1,
                                    prefix_cache_blocks=0) for v in args.variants}

        def gen(v, budget, seed, prompts=prompts, engines=engines):
            _, kernels, allowed = VARIANTS[v]
            params = [SamplingParams(max_new_tokens=budget, temperature=1.0, seed=seed + i) for i in range(len(prompts))]
            with ops.use_kernels(kernels), rows_mm_allowed(allowed):
                return cpu_seconds(lambda: engines[v].generate(prompts, params))

        for v in args.variants:
            gen(v, short, 0)  # warm: probes, copies, fresh memory
        results[batch] = interleaved({v: (lambda v=v: (gen(v, long, 7) - gen(v, short, 7)) / (long - short))
                                      for v in args.variants}, args.reps)
        print(f"batch {batch}: " + "  ".join(f"{v} {statistics.median(t) * 1e3:.1f} ms" for v, t in results[batch].items()),
              flush=True)

    print("\nCPU ms per decode step (median)\n| batch | " + " | ".join(args.variants) + " |\n|---|" + "---|" * len(args.variants))
    for batch, times in results.items():
        print(f"| {batch} | " + " | ".join(f"{statistics.median(times[v]) * 1e3:.1f}" for v in args.variants) + " |")
    pairs = [(a, b) for a, b in (("bf16-consistent", "f32-consistent"), ("bf16-consistent", "bf16-fast"),
                                 ("bf16-consistent", "bf16-copy"), ("f32-consistent", "f32-fast"))
             if a in args.variants and b in args.variants]
    print("\nspeed ratios (median of paired repetitions; > 1: the first is faster)\n| batch | "
          + " | ".join(f"{a} / {b}" for a, b in pairs) + " |\n|---|" + "---|" * len(pairs))
    for batch, times in results.items():
        print(f"| {batch} | " + " | ".join(f"{paired_ratio(times, a, b):.2f}" for a, b in pairs) + " |")
    print("\nweight bytes held after decoding (parameters + kept copies): "
          + ", ".join(f"{v} {held_bytes(model_of[v]) / 1e6:.0f} MB" for v in args.variants))


if __name__ == "__main__":
    main()
