"""Megatron learner step time with pipeline parallelism (Megatron's 1F1B schedule over gloo, schedule.py) against
one process and against data parallelism on the same 2 ranks: one RL update (runtime.Learner.rl_step: the
forward-only pass for the whole batch's logprobs, the loss, the second pass forward + backward per micro-batch,
the fixed-tree gradient sums, Adam, the mirror's weights) of the default job's model (hidden 64, 2 layers,
intermediate 192, 4/2 heads) on a default-sized batch (32 prompts x 8 samples), consistent kernels, 1 torch thread
per process.

Each round runs the one-process learner (grad_shares 2) here, then one launch of 2 ranks that times pp=2 with 2
and with 4 micro-batches (grad_shares) and dp=2, one after another; each is reported as a ratio to the same
round's one-process time (median over rounds): absolute times move with whatever else the machine runs. Step
time is rank 0's wall clock, the median of --steps steps after one warm-up step.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/megatron_pipeline.py --rounds 3
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nemo_rz import ops
from nemo_rz.algorithms.advantages import group_advantages
from nemo_rz.generation.packing import Packed
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.runtime.megatron import distributed, launch
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.learner import MegatronLearner

LAYOUTS = {"pp2, 2 micro-batches": Layout(pp=2, grad_shares=2), "pp2, 4 micro-batches": Layout(pp=2, grad_shares=4),
           "dp2 (2 shares)": Layout(dp=2, grad_shares=2)}


def model(args) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=args.vocab, hidden_size=64, intermediate_size=192, num_layers=2,
                                 num_heads=4, num_kv_heads=2)).eval()


def batch(args) -> tuple[Packed, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rows, length = args.rows, args.length
    ids = torch.randint(0, args.vocab, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length - 1)[None, :] >= 8) & (torch.arange(length - 1)[None, :] < lengths[:, None] - 1)
    rollout = -torch.rand(rows, length - 1, generator=g) * mask
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    return Packed(ids, lengths, rollout, mask.float()), group_advantages(rewards, 8)


def timed(layout: Layout, args) -> float | None:
    """Median seconds of an RL update at `layout` (every rank takes part; rank 0 returns the time)."""
    if torch.distributed.get_rank():
        MegatronLearner.follow()
        return None
    lrn = MegatronLearner(model(args), layout, 1e-4, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    b, adv = batch(args)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        lrn.rl_step(b, adv)
        times.append(time.perf_counter() - t0)
    lrn.stop()
    return statistics.median(times[1:])


def ranks(args) -> None:
    lines = []
    for name, layout in LAYOUTS.items():
        distributed.init(layout)
        seconds = timed(layout, args)
        lines.append(f"{name}\t{seconds}\n")
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text("".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--length", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops.set_kernels("consistent")
    if launch.this_rank() is not None:
        return ranks(args)
    print(f"date {datetime.date.today()}  torch {torch.__version__}  1 thread per process; 2 ranks on "
          f"{len(os.sched_getaffinity(0))} core(s), load average {os.getloadavg()[0]:.1f}; batch [{args.rows}, "
          f"{args.length}]; {args.rounds} rounds x {args.steps} steps")
    distributed.init(Layout())
    one, ratios = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        for r in range(args.rounds):
            one.append(timed(Layout(grad_shares=2), args))
            code = launch.start([sys.executable, __file__, *sys.argv[1:], "--out", out], 2)
            if code:
                raise SystemExit(f"round {r}: the 2-rank launch failed (exit code {code})")
            for line in Path(out).read_text().splitlines():
                name, seconds = line.split("\t")
                ratios.setdefault(name, []).append(float(seconds) / one[-1])
            print(f"round {r}: one process {one[-1]:.3f} s; " + ", ".join(f"{n} x{v[-1]:.2f}" for n, v in ratios.items()),
                  flush=True)
    print(f"\n| layout (2 ranks) | step / one process's (median of {args.rounds} paired rounds) | min | max |")
    print("|---|---|---|---|")
    print(f"| one process, 2 shares | 1 ({statistics.median(one):.3f} s median) | | |")
    for name, v in ratios.items():
        print(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")
    print(f"(load average at the end {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
