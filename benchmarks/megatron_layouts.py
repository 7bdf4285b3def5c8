"""Megatron learner step time per process layout against one process: one RL update (runtime.Learner.rl_step:
forward, loss, backward, the fixed-tree gradient sums, Adam, the mirror's weights) on the same model and batch,
consistent kernels, 1 torch thread per process.

Each round runs the one-process learner here, then one launch of --world ranks (launch.start) that times every
layout of layout.layouts_of(world) that the learner drives, one after another, then the one process again: rounds
interleave the variants, and each layout's time is reported as a ratio to the mean of the one-process times just
before and after it (median over rounds), since absolute times move with whatever else the machine runs. Step
time is rank 0's wall clock (it waits for the other ranks' collectives), the median of --steps steps after one
warm-up step; the learner is built per layout (Megatron's groups are re-initialised for it), outside the timing.
With more ranks than cores the ranks take turns (launch.py): on 2 cores, 4 ranks measure the layouts' overhead
under oversubscription, not their speed-up.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/megatron_layouts.py --world 4 --rounds 3
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

from nemo_rz.algorithms.advantages import group_advantages
from nemo_rz.generation.packing import Packed
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.runtime.megatron import distributed, launch
from nemo_rz.runtime.megatron.layout import Layout, layouts_of
from nemo_rz.runtime.megatron.learner import MegatronLearner


def model(args) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                 num_layers=args.layers, num_heads=4, num_kv_heads=2)).eval()


def batch(args) -> tuple[Packed, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rows, length = args.rows, args.length
    ids = torch.randint(0, args.vocab, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length - 1)[None, :] >= 4) & (torch.arange(length - 1)[None, :] < lengths[:, None] - 1)
    rollout = -torch.rand(rows, length - 1, generator=g) * mask
    rewards = torch.randint(0, 2, (rows,), generator=g).float()
    return Packed(ids, lengths, rollout, mask.float()), group_advantages(rewards, 4)


def timed(layout: Layout, args) -> float | None:
    """Median seconds of an RL update at `layout` (every rank takes part; rank 0 returns the time; None where the
    learner refuses the layout)."""
    if torch.distributed.get_rank():
        try:
            MegatronLearner.follow()
        except ValueError:  # refused in the constructor, as on rank 0
            pass
        return None
    try:
        lrn = MegatronLearner(model(args), layout, 1e-4, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    except ValueError as e:  # a combination the learner does not drive (one line)
        print(f"{layout}: refused: {e}", file=sys.stderr)
        return None
    b, adv = batch(args)
    times = []
    for _ in range(args.steps + 1):
        t0 = time.perf_counter()
        lrn.rl_step(b, adv)
        times.append(time.perf_counter() - t0)
    lrn.stop()
    return statistics.median(times[1:])


def ranks(args) -> None:
    """One launched rank: every layout in turn; rank 0 writes `name seconds` lines to --out."""
    lines = []
    for name, layout in layouts_of(args.world, refused=tuple(distributed.NOT_YET)).items():
        distributed.init(layout)
        seconds = timed(layout, args)
        if seconds is not None:
            lines.append(f"{name} {seconds}\n")
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text("".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--length", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if launch.this_rank() is not None:
        return ranks(args)
    print(f"date {datetime.date.today()}  torch {torch.__version__}  1 thread per process; {args.world} ranks on "
          f"{len(os.sched_getaffinity(0))} core(s); model hidden {args.hidden} x {args.layers} layers, vocab "
          f"{args.vocab}; batch [{args.rows}, {args.length}]; {args.rounds} rounds x {args.steps} steps")
    distributed.init(Layout())
    one, ratios = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times")
        for r in range(args.rounds):
            before = timed(Layout(), args)
            code = launch.start([sys.executable, __file__, *sys.argv[1:], "--out", out], args.world)
            if code:
                raise SystemExit(f"round {r}: the {args.world}-rank launch failed (exit code {code})")
            one.append((before + timed(Layout(), args)) / 2)  # the one process just before and just after
            for line in Path(out).read_text().splitlines():
                name, seconds = line.split()
                ratios.setdefault(name, []).append(float(seconds) / one[-1])
            print(f"round {r}: one process {one[-1]:.3f} s; " + ", ".join(f"{n} x{v[-1]:.2f}" for n, v in ratios.items()),
                  flush=True)
    print(f"\n| layout ({args.world} ranks) | step / one process's (median of {args.rounds} paired rounds) | min | max |")
    print("|---|---|---|---|")
    print(f"| one process | 1 ({statistics.median(one):.3f} s median) | | |")
    for name, v in ratios.items():
        print(f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} |")


if __name__ == "__main__":
    main()
