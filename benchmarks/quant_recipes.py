"""Low-precision recipes (precision.recipe) measured against float32 on CPU.

Per recipe:
1. layer error: ||Q-layer(x) - x @ W.T|| / ||x @ W.T|| (Frobenius, float64 reference) for random x, W at two
   shapes: the default job's MLP up-projection (64 -> 192) and SmolLM2-135M's (576 -> 1536);
2. logprob difference on the default task: the default job's model after its supervised warm-up, its own
   float32 samples for one update's prompts (32 x 8, temperature 1), scored by the same weights at each
   recipe: mean and max |logprob - float32 logprob| over the sampled tokens;
3. rollout tokens/s of those requests on the built-in engine, consistent vs fast kernels (interleaved reps,
   process CPU time, median);
4. with --train N: `python -m nemo_rz.train precision.recipe=R algo.updates=N` per recipe (the default job
   otherwise): mean reward of the first and last 10 updates, held-out greedy pass@1 at start and end, and the
   sum of kernel_diff_tokens over the decomposition updates (0 = zero mismatch).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/quant_recipes.py [--train 100]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from nemo_rz import ops
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.quant.apply import apply_precision
from nemo_rz.quant.linear import PRECISIONS, Precision, QuantizedLinear

SHAPES = {"default job 64->192": (64, 192), "SmolLM2-135M 576->1536": (576, 1536)}


def layer_errors(recipe: str, rows: int = 64, seed: int = 0) -> dict[str, float]:
    out = {}
    for name, (k, n) in SHAPES.items():
        g = torch.Generator().manual_seed(seed)
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g) * k ** -0.5
        ref = x.double() @ w.double().T
        if recipe == "none":
            y = ops.linear(x, w).double()
        else:
            with torch.no_grad():
                y = QuantizedLinear(torch.nn.Parameter(w), None, Precision(recipe))(x).double()
        out[name] = float((y - ref).norm() / ref.norm())
    return out


def warmed_default_model():
    """The default job's model after its warm-up, and one update's prompts (a Trainer in a scratch run dir)."""
    from nemo_rz import config
    from nemo_rz.runtime.trainer import Trainer

    cfg = config.load(overrides=["eval.n=50", "progress=false", "metrics.tensorboard=false"])
    run_dir = Path(tempfile.mkdtemp(prefix="quant_bench_"))
    trainer = Trainer(cfg, run_dir, log=lambda *a, **k: None)
    return trainer.model.eval(), trainer.job(1).prompts


def logprob_differences(model, prompts) -> tuple[dict[str, tuple[float, float]], list]:
    outs = RolloutEngine(model, max_batch_size=len(prompts)).generate(prompts, SamplingParams(6, temperature=1.0, seed=1))
    batch = pack(outs)
    mask = batch.mask.bool()
    with torch.no_grad():
        ref = model.token_logprobs(batch.input_ids, batch.lengths)[mask]
    result = {}
    for recipe in PRECISIONS:
        q = apply_precision(copy.deepcopy(model), recipe)
        with torch.no_grad():
            d = (q.token_logprobs(batch.input_ids, batch.lengths)[mask] - ref).abs()
        result[recipe] = (float(d.mean()), float(d.max()))
    return result, outs


def throughput(model, prompts, reps: int) -> dict[str, dict[str, float]]:
    models = {r: apply_precision(copy.deepcopy(model), r) for r in PRECISIONS}
    times: dict[tuple[str, str], list[float]] = {}
    tokens = {}
    for rep in range(reps):
        for recipe, m in models.items():
            for mode in ("consistent", "fast")[:: 1 if rep % 2 == 0 else -1]:
                engine = RolloutEngine(m, max_batch_size=len(prompts))
                with ops.use_kernels(mode):
                    c0 = time.process_time()
                    outs = engine.generate(prompts, SamplingParams(6, temperature=1.0, seed=rep))
                    dt = time.process_time() - c0
                tokens[(recipe, mode)] = sum(len(o.token_ids) for o in outs)
                times.setdefault((recipe, mode), []).append(tokens[(recipe, mode)] / dt)
    return {r: {mode: statistics.median(times[(r, mode)]) for mode in ("consistent", "fast")} for r in PRECISIONS}


def train(recipe: str, updates: int, root: Path) -> dict:
    run_dir = root / recipe
    cmd = [sys.executable, "-m", "nemo_rz.train", f"precision.recipe={recipe}", f"algo.updates={updates}",
           "eval.n=200", f"eval.every={updates}", "checkpoint.every=0", "metrics.decomposition_every=10",
           "progress=false", f"run_dir={run_dir}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    diffs = [r["kernel_diff_tokens"] for r in rows if "kernel_diff_tokens" in r]
    return {"reward_start": statistics.mean(r["reward"] for r in rows[:10]),
            "reward_end": statistics.mean(r["reward"] for r in rows[-10:]),
            "pass_start": summary["heldout_pass_at_1_start"], "pass_end": summary["heldout_pass_at_1_end"],
            "kernel_diff_tokens": sum(diffs), "decompositions": len(diffs), "seconds": summary["seconds"],
            "cmd": " ".join(cmd[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="throughput repetitions (interleaved)")
    ap.add_argument("--train", type=int, default=0, metavar="UPDATES", help="also train each recipe this many updates")
    ap.add_argument("--recipes", nargs="*", default=list(PRECISIONS), help="recipes to train (--train)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    print("| recipe | " + " | ".join(f"layer rel. error {s}" for s in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for recipe in PRECISIONS:
        print(f"| {recipe} | " + " | ".join(f"{e:.2e}" for e in layer_errors(recipe).values()) + " |")

    model, prompts = warmed_default_model()
    dlp, _ = logprob_differences(model, prompts)
    tps = throughput(model, prompts, args.reps)
    print("\n| recipe | mean abs dlp | max abs dlp | consistent tok/s | fast tok/s | consistent/fast |")
    print("|---|---|---|---|---|---|")
    for recipe in PRECISIONS:
        c, f = tps[recipe]["consistent"], tps[recipe]["fast"]
        print(f"| {recipe} | {dlp[recipe][0]:.2e} | {dlp[recipe][1]:.2e} | {c:.0f} | {f:.0f} | {c / f:.2f}x |")

    if args.train:
        root = Path(tempfile.mkdtemp(prefix="quant_train_"))
        print("\n| recipe | reward first 10 | reward last 10 | held-out pass@1 start -> end | kernel_diff_tokens "
              "(decompositions) | seconds |")
        print("|---|---|---|---|---|---|")
        for recipe in args.recipes:
            r = train(recipe, args.train, root)
            print(f"| {recipe} | {r['reward_start']:.3f} | {r['reward_end']:.3f} | {r['pass_start']:.3f} -> "
                  f"{r['pass_end']:.3f} | {r['kernel_diff_tokens']} ({r['decompositions']}) | {r['seconds']:.0f} |",
                  flush=True)
        print(f"\nrun directories: {root}; command: python {r['cmd']}")


if __name__ == "__main__":
    main()
