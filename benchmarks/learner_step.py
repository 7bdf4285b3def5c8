"""Learner step cost: `Decoder.token_logprobs` forward + backward on a [batch, length] batch, consistent vs fast
kernels, same weights and tokens, interleaved (order alternates every repetition), 1 torch thread.

Reports process CPU time per step (median) and speed consistent/fast (median of per-repetition paired ratios;
target >= 0.9). The first step of each mode is a warm-up (it also runs the start-up probes of ops/verified.py).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/learner_step.py --preset smollm2-135m --batch 16 --length 64
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

from nemo_rz import ops  # noqa: E402

MODES = ("consistent", "fast")


def step(model, ids: torch.Tensor, mode: str) -> tuple[float, float]:
    """(forward, backward) process CPU seconds of one learner step."""
    with ops.use_kernels(mode):
        model.zero_grad(set_to_none=True)
        c0 = time.process_time()
        lp = model.token_logprobs(ids)
        c1 = time.process_time()
        lp.sum().backward()
        return c1 - c0, time.process_time() - c1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes.add_arguments(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, _, desc = shapes.load(args, args.seed)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(args.seed))
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"model {desc}; batch [{args.batch}, {args.length}]")
    for mode in MODES:
        step(model, ids, mode)  # warm-up
    times = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            fwd, bwd = step(model, ids, mode)
            times[mode].append((fwd, bwd))
            print(f"rep {rep + 1} {mode}: forward {fwd:.2f}s backward {bwd:.2f}s", flush=True)
    print("\n| mode | forward s | backward s | step s |\n|---|---|---|---|")
    for mode in MODES:
        f = statistics.median(t[0] for t in times[mode])
        b = statistics.median(t[1] for t in times[mode])
        s = statistics.median(sum(t) for t in times[mode])
        print(f"| {mode} | {f:.2f} | {b:.2f} | {s:.2f} |")
    ratio = statistics.median(sum(f) / sum(c) for c, f in zip(times["consistent"], times["fast"]))
    print(f"\nspeed consistent/fast (median paired): {ratio:.2f}x  target >= 0.9: {'MET' if ratio >= 0.9 else 'MISSED'}")


if __name__ == "__main__":
    main()
