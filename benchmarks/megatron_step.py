"""Learner step time, the Megatron learner against the built-in Decoder: `token_logprobs` forward + backward on
a [batch, length] batch, consistent vs fast kernels, TP=1 or TP=2 (2 processes over gloo, started here), the
same weights and tokens everywhere, 1 torch thread per process.

Reports wall-clock seconds per step (median of --reps after one warm-up step per variant; wall clock because
at TP=2 the ranks also wait for each other), each variant's median ratio to the built-in consistent learner's
step of the same repetition (the variants run interleaved, so the ratios hold under load better than the
times), and whether the logprobs equal the built-in Decoder's consistent ones bit for bit.

Model: a benchmarks/shapes.py preset (--preset smollm2-135m: SmolLM2's shape), or --gemma3-tiny, a Gemma-3-shaped
tiny model (random init: Gemma norms and sandwich, GELU-tanh, scaled tied embeddings, 5 sliding layers of window
--window to 1 full, the sliding layers' own RoPE theta, query_pre_attn_scalar). A variant the Megatron learner
refuses (its fast kernels have no sliding window or sandwich norms) is listed with its one-line reason.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/megatron_step.py --preset tiny --tp 2
    python benchmarks/megatron_step.py --gemma3-tiny
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
from nemo_rz.models import Decoder, DecoderConfig  # noqa: E402
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


def gemma3_tiny(seed: int, window: int) -> tuple[Decoder, str]:
    """A Gemma-3-shaped tiny model (Gemma 3 270M's proportions, smaller): 6 layers, 5 sliding to 1 full."""
    cfg = DecoderConfig(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=6, num_heads=4, num_kv_heads=1,
                        head_dim=64, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=64.0, qk_norm=True,
                        tie_word_embeddings=True, sliding_window=window, norm="gemma", sandwich_norm=True,
                        hidden_act="gelu_tanh", embed_scale=True,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(6)])
    torch.manual_seed(seed)
    model = Decoder(cfg).eval()
    desc = (f"gemma3-tiny: vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, intermediate {cfg.intermediate_size}, "
            f"layers {cfg.num_layers} (5 sliding of window {window}, 1 full), heads {cfg.num_heads}/{cfg.num_kv_heads} kv, "
            f"head_dim {cfg.head_dim}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params")
    return model, desc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes.add_arguments(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gemma3-tiny", action="store_true", help="a Gemma-3-shaped tiny model instead of --preset")
    ap.add_argument("--window", type=int, default=16, help="--gemma3-tiny's sliding window")
    args = ap.parse_args()
    if args.tp > 1 and launch.this_rank() is None:
        raise SystemExit(launch.start([sys.executable, *sys.argv], args.tp))
    torch.set_num_threads(1)
    if args.gemma3_tiny:
        decoder, desc = gemma3_tiny(args.seed, args.window)
    else:
        decoder, _, desc = shapes.load(args, args.seed)  # before torch.distributed: transformers saves on rank 0 only
    distributed.init(Layout(tp=args.tp))
    lead = torch.distributed.get_rank() == 0
    ids = torch.randint(0, decoder.config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(args.seed))
    variants, refused = {}, {}
    for mode in MODES:
        try:
            with ops.use_kernels(mode):
                policy = MegatronPolicy(decoder.config)
        except ValueError as e:  # what the Megatron learner cannot run in this kernel set
            refused[f"megatron tp={args.tp} {mode}"] = str(e)
        else:
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
    base = "built-in consistent" if "built-in consistent" in variants else next(iter(variants))
    for name, (model, mode) in variants.items():
        _, lp = step(model, ids, mode)  # warm-up (and the start-up probes of ops/verified.py)
        equal[name] = torch.equal(lp, reference)
    for rep in range(args.reps):
        for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            model, mode = variants[name]
            times[name].append(step(model, ids, mode)[0])
    if lead:
        print(f"\n| learner | step s (median) | / {base} (median of paired ratios) | logprobs = built-in consistent, "
              "bit for bit |\n|---|---|---|---|")
        for name in variants:
            ratio = statistics.median(a / b for a, b in zip(times[name], times[base]))
            print(f"| {name} | {statistics.median(times[name]):.3f} | {ratio:.2f} | {'yes' if equal[name] else 'no'} |")
        for name, why in refused.items():
            print(f"| {name} | refused: {why} | | |")


if __name__ == "__main__":
    main()
