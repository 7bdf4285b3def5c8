"""Learner step time, the Megatron learner against the built-in Decoder: `token_logprobs` forward + backward on
a [batch, length] batch, consistent vs fast kernels, TP=1 or TP=2 (2 processes over gloo, started here), the
same weights and tokens everywhere, 1 torch thread per process.

Reports wall-clock seconds per step (median of --reps after one warm-up step per variant; wall clock because
at TP=2 the ranks also wait for each other) and whether the logprobs equal the built-in Decoder's consistent
ones bit for bit.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/megatron_step.py --preset tiny --tp 2
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
from nemo_rz.runtime.megatron import distributed, launch  # noqa: E402
from nemo_rz.runtime.megatron.layout import Layout  # noqa: E402
from nemo_rz.runtime.megatron.model import MegatronPolicy  # noqa: E402

MODES = ("consistent", "fast")


def step(model, ids: torch.Tensor, mode: str) -> tuple[float, torch.Tensor]:
    with ops.use_kernels(mode):
        model.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        t0 = time.perf_counter()
        lp = model.token_logprobs(ids)
        lp.sum().backward()
        torch.distributed.barrier()
        return time.perf_counter() - t0, lp.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes.add_arguments(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.tp > 1 and launch.this_rank() is None:
        raise SystemExit(launch.start([sys.executable, *sys.argv], args.tp))
    torch.set_num_threads(1)
    decoder, _, desc = shapes.load(args, args.seed)  # before torch.distributed: transformers saves on rank 0 only
    distributed.init(Layout(tp=args.tp))
    lead = torch.distributed.get_rank() == 0
    ids = torch.randint(0, decoder.config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(args.seed))
    variants = {}
    for mode in MODES:
        with ops.use_kernels(mode):
            policy = MegatronPolicy(decoder.config)
        policy.load_state_dict(decoder.state_dict())
        variants[f"megatron tp={args.tp} {mode}"] = (policy.train(), mode)
        if args.tp == 1:
            variants[f"built-in {mode}"] = (decoder.train(), mode)
    with ops.use_kernels("consistent"), torch.no_grad():
        reference = decoder.token_logprobs(ids)
    if lead:
        print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()} x {args.tp} process(es)")
        print(f"model {desc}; batch [{args.batch}, {args.length}]")
    times, equal = {k: [] for k in variants}, {}
    for name, (model, mode) in variants.items():
        _, lp = step(model, ids, mode)  # warm-up (and the start-up probes of ops/verified.py)
        equal[name] = torch.equal(lp, reference)
    for rep in range(args.reps):
        for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            model, mode = variants[name]
            times[name].append(step(model, ids, mode)[0])
    if lead:
        print("\n| learner | step s (median) | logprobs = built-in consistent, bit for bit |\n|---|---|---|")
        for name in variants:
            print(f"| {name} | {statistics.median(times[name]):.3f} | {'yes' if equal[name] else 'no'} |")


if __name__ == "__main__":
    main()
