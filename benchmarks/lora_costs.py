"""LoRA against full fine-tuning on one model: learner step time, optimizer state, and the bytes one weight version
ships to the rollout workers (SharedWeightRing.publish: a LoRA base is held once, a version writes its adapters;
with --ray also RayBackend.publish's object-store puts: the base once, then the adapters per version).

With --moe the model is conf/moe_tiny.yaml's shape (4 experts, top-2, Qwen3-MoE routing; random weights) and the
variants are full fine-tuning, LoRA without the experts (attention: that model has no dense MLP), LoRA with them
(lora.modules=all: attention and both expert products, an A and a B per expert) and with a shared expert A; the
variants run --pairs times in alternating order (paired under a loaded machine):

    python benchmarks/lora_costs.py --moe --rank 8 --reps 5 --pairs 2

Each variant runs in a fresh subprocess (peak RSS is its ru_maxrss): the model loaded in float32 (or a random
DecoderConfig of SmolLM2-135M's shape without --model), then `Learner.sft_step` (forward, backward, Adam) on a
[batch, length] batch of random tokens: one warm-up step, then --reps timed steps (median wall and process CPU).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/lora_costs.py --model models/smollm2-135m-instruct --rank 16 --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

# variant: lora.* of the adapted variants ("full": none)
VARIANTS = {"lora": dict(modules="all")}
MOE_VARIANTS = {"full": None, "lora_no_experts": dict(modules="attention,mlp"), "lora_experts": dict(modules="all"),
                "lora_experts_shared_a": dict(modules="all", expert_a="shared")}


def _model(path: str | None, moe: bool = False):
    from nemo_rz.models import Decoder, DecoderConfig
    from nemo_rz.models.hf import load_hf

    if moe:  # conf/moe_tiny.yaml's shape over the default model (character vocabulary)
        return Decoder(DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                                     num_kv_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                                     moe_intermediate_size=96))
    if path:
        return load_hf(path, "float32")
    return Decoder(DecoderConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                                 num_kv_heads=3, max_position_embeddings=2048, tie_word_embeddings=True))


def child(args) -> dict:
    from nemo_rz import ops
    from nemo_rz.models import lora
    from nemo_rz.runtime.learner import Learner
    from nemo_rz.runtime.weights import SharedWeightRing

    torch.set_num_threads(1)
    ops.set_kernels("consistent")
    torch.manual_seed(0)
    model = _model(args.model, args.moe)
    spec = {**VARIANTS, **MOE_VARIANTS}.get(args.variant)
    if spec is not None:
        lora.apply_lora(model, dict(rank=args.rank, alpha=2.0 * args.rank, **spec), seed=0)
    learner = Learner(model, 1e-4, 1.0, 1.0, "reinforce_zero", "none", {})
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(1))
    lengths = torch.full((args.batch,), args.length)
    target = torch.zeros(args.batch, args.length - 1)
    target[:, args.length // 2:] = 1.0
    learner.sft_step(ids, lengths, target)  # warm-up (start-up probes)
    walls, cpus = [], []
    for _ in range(args.reps):
        w, c = time.perf_counter(), time.process_time()
        learner.sft_step(ids, lengths, target)
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    opt_bytes = sum(t.numel() * t.element_size() for s in learner.opt.state.values() for t in s.values() if torch.is_tensor(t))
    first = learner.weights(0)
    ring = SharedWeightRing(first.flat(), 2, first.static_names())
    shipped = ring.publish(1, learner.weights(1).flat())
    ray_shipped = None
    if args.ray:  # the Ray back-end's object-store puts for the same two versions (a private cluster, no actors)
        from nemo_rz.runtime.ray_backend import RayBackend

        backend = RayBackend({}, num_workers=0, ring_slots=2)
        try:
            backend.publish(0, first.flat())
            ray_shipped = dict(base_once=backend.static_bytes, per_update=backend.publish(1, learner.weights(1).flat()))
        finally:
            backend.close()
    return dict(variant=args.variant, rank=args.rank if spec is not None else None,
                trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                optimizer_state_bytes=opt_bytes, shipped_bytes_per_update=shipped, ray_shipped_bytes=ray_shipped,
                step_wall_s=statistics.median(walls), step_cpu_s=statistics.median(cpus),
                peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a checkpoint directory (default: a random SmolLM2-135M-shaped model)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ray", action="store_true", help="also the bytes RayBackend.publish puts in Ray's object store")
    p.add_argument("--moe", action="store_true", help="conf/moe_tiny.yaml's shape; LoRA with and without the experts")
    p.add_argument("--pairs", type=int, default=2, help="--moe: runs of every variant, in alternating order")
    p.add_argument("--variant", choices=("full", *VARIANTS, *MOE_VARIANTS), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(child(args)))
        return
    if args.moe:
        moe_main(args)
        return
    rows = []
    for variant in ("full", "lora"):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, *sys.argv[1:]], capture_output=True,
                             text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    full, ad = rows
    print(json.dumps(dict(load_average=os.getloadavg(), model=args.model or "random SmolLM2-135M shape", batch=args.batch,
                          length=args.length, rows=rows,
                          optimizer_state_ratio=ad["optimizer_state_bytes"] / full["optimizer_state_bytes"],
                          shipped_ratio=ad["shipped_bytes_per_update"] / full["shipped_bytes_per_update"],
                          step_cpu_ratio=ad["step_cpu_s"] / full["step_cpu_s"]), indent=1))


def moe_main(args) -> None:
    names, runs = list(MOE_VARIANTS), {v: [] for v in MOE_VARIANTS}
    for i in range(args.pairs):
        for variant in names if i % 2 == 0 else names[::-1]:
            out = subprocess.run([sys.executable, __file__, "--variant", variant, *sys.argv[1:]], capture_output=True,
                                 text=True, check=True).stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
    cpu = {v: statistics.median(r["step_cpu_s"] for r in rows) for v, rows in runs.items()}
    print(json.dumps(dict(load_average=os.getloadavg(), model="conf/moe_tiny.yaml shape (random)", batch=args.batch,
                          length=args.length, rank=args.rank, rows={v: rows[0] | dict(step_cpu_s_runs=[r["step_cpu_s"] for r in rows],
                                                                                    step_wall_s_runs=[r["step_wall_s"] for r in rows])
                                                                 for v, rows in runs.items()},
                          step_cpu_ratio_to_no_experts={v: cpu[v] / cpu["lora_no_experts"] for v in cpu},
                          step_cpu_ratio_to_full={v: cpu[v] / cpu["full"] for v in cpu}), indent=1))


if __name__ == "__main__":
    main()
