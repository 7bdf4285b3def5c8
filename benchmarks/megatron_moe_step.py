"""Mixture-of-experts learner step time on the Megatron learner, expert parallelism EP=1 against EP=2, on 2
processes (megatron.dp=2, gloo, started here, 1 torch thread each): `token_logprobs` forward + backward of
each rank's own [batch / 2, length] rows, consistent kernels, the same weights and tokens for both layouts.

EP=1: each rank runs all experts on its own tokens. EP=2: the tokens are all-gathered over the 2 ranks, each
rank runs its 2 of the 4 experts on both ranks' tokens, the pair outputs return by one all-to-all
(runtime/megatron/moe.py). Reports wall-clock seconds per step (median of --reps after one warm-up step each;
the layouts run interleaved, so the median paired ratio holds under load better than the times) and whether
both layouts' logprobs equal the built-in Decoder's bit for bit.

Model: conf/moe_tiny.yaml's (hidden 64, 2 layers, 4 heads / 2 kv, layer 0 sliding window 8, attention sinks,
4 experts of 96, k=2; vocabulary --vocab), or --hidden / --experts / --expert-size for a larger one.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/megatron_moe_step.py
    python benchmarks/megatron_moe_step.py --hidden 256 --experts 8 --expert-size 512 --batch 16 --length 64
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

from nemo_rz import ops
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.runtime.megatron import distributed, launch
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.model import MegatronPolicy

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_step  # noqa: E402  (the timed forward + backward step)


def step(model, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    return megatron_step.step(model, ids, "consistent")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="rows in all (each rank its half)")
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--expert-size", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if launch.this_rank() is None:
        raise SystemExit(launch.start([sys.executable, *sys.argv], 2))
    torch.set_num_threads(1)
    cfg = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_position_embeddings=max(64, args.length), sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], attention_sinks=True,
                        num_experts=args.experts, num_experts_per_tok=2, moe_intermediate_size=args.expert_size)
    torch.manual_seed(args.seed)
    decoder = Decoder(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(args.seed))
    policies = {}
    with ops.use_kernels("consistent"):
        for ep in (1, 2):  # a layer keeps the groups it was built with, so both can run after the second init
            distributed.init(Layout(dp=2, ep=ep))
            policies[f"EP={ep}"] = MegatronPolicy(cfg)
            policies[f"EP={ep}"].load_state_dict(decoder.state_dict())
        rank = torch.distributed.get_rank()
        mine = ids.chunk(2)[rank]
        with torch.no_grad():
            reference = decoder.token_logprobs(mine)
        times, equal = {k: [] for k in policies}, {}
        for name, policy in policies.items():
            equal[name] = torch.equal(step(policy.train(), mine)[1], reference)  # warm-up
        for rep in range(args.reps):
            for name in (list(policies) if rep % 2 == 0 else list(policies)[::-1]):
                times[name].append(step(policies[name], mine)[0])
    flags = [None, None]
    torch.distributed.all_gather_object(flags, equal)
    if rank == 0:
        print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()} x 2 processes (dp=2)")
        print(f"model: moe_tiny-shaped, vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_experts} experts of "
              f"{cfg.moe_intermediate_size}, k={cfg.num_experts_per_tok}; batch [{args.batch}, {args.length}] (half per rank)")
        print("\n| layout | step s (median) | / EP=1 (median of paired ratios) | logprobs = Decoder, bit for bit (both ranks) |"
              "\n|---|---|---|---|")
        for name in policies:
            ratio = statistics.median(a / b for a, b in zip(times[name], times["EP=1"]))
            print(f"| {name} | {statistics.median(times[name]):.4f} | {ratio:.2f} | {'yes' if all(f[name] for f in flags) else 'no'} |")


if __name__ == "__main__":
    main()
