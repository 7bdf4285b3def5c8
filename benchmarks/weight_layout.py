"""Memory and time of the Linear weight layout: the [N, K] parameter over contiguous [K, N] storage (models/layers.py,
the GEMM operand itself: "after") against contiguous [N, K] parameters, each of which the consistent GEMM route
copies to [K, N] on first use ("before", --usual in a child: the weights copied into the usual layout after load).

Each repetition starts one fresh interpreter per variant (which goes first alternates): load_hf, then the first
RolloutEngine.generate (prefill --batch x --prompt tokens, one decode step); reported: peak RSS after it
(ru_maxrss: the load's own peak may hide what follows) and RSS then (VmRSS), the first forward's CPU seconds,
and the steady decode step at batch 1 and 8 in the consistent and fast kernel sets ((generate of 4 + --steps
new tokens - generate of 4) / --steps, median of --trials). --decode-ab times only the decode steps, both variants
in one process, trials interleaved (the paired ratios are less noisy than across processes).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/weight_layout.py --model models/smollm2-135m-instruct --reps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = ("after", "before")
DECODE = [(mode, b) for mode in ("consistent", "fast") for b in (1, 8)]


def _rss_mb() -> float:
    """This process's resident set now (Linux /proc), MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def child(args) -> None:
    """One fresh process: its measurements as one JSON line."""
    import resource

    import torch

    from nemo_rz import ops
    from nemo_rz.generation import RolloutEngine, SamplingParams
    from nemo_rz.models.hf import load_hf

    torch.set_num_threads(args.threads)
    model = load_hf(args.model, "float32")
    if args.usual:
        _usual(model)
    engine = RolloutEngine(model, max_batch_size=8, max_model_len=args.prompt + 4 + args.steps + 4)
    prompts = [[(7 * i + 3 * j) % model.config.vocab_size for j in range(args.prompt)] for i in range(8)]
    c = time.process_time()
    engine.generate(prompts[: args.batch], SamplingParams(max_new_tokens=2, seed=0))
    out = {"first_cpu": time.process_time() - c, "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "rss_mb": _rss_mb()}
    for mode, b in DECODE:
        with ops.use_kernels(mode):
            _step_s(engine, prompts[:b], args.steps)  # warm
            out[f"{mode}_b{b}_ms"] = 1e3 * statistics.median(_step_s(engine, prompts[:b], args.steps) for _ in range(args.trials))
    print(json.dumps(out), flush=True)


def _usual(model):
    """The "before" variant: every Linear weight copied into a contiguous [N, K] parameter."""
    import torch

    from nemo_rz.models.layers import Linear

    for m in model.modules():
        if isinstance(m, Linear):
            m.weight = torch.nn.Parameter(m.weight.detach().contiguous(), requires_grad=m.weight.requires_grad)
    return model


def _step_s(engine, prompts, steps: int) -> float:
    """Seconds of one decode step: generate of 4 + steps new tokens minus generate of 4."""
    from nemo_rz.generation import SamplingParams

    def run(n):
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_new_tokens=n, seed=0))
        return time.perf_counter() - t

    return (run(4 + steps) - run(4)) / steps


def decode_ab(args) -> None:
    """Both variants in this one process, decode trials interleaved: paired after/before step-time ratios."""
    import torch

    from nemo_rz import ops
    from nemo_rz.generation import RolloutEngine
    from nemo_rz.models.hf import load_hf

    torch.set_num_threads(args.threads)
    models = {"after": load_hf(args.model, "float32"), "before": _usual(load_hf(args.model, "float32"))}
    engines = {v: RolloutEngine(m, max_batch_size=8, max_model_len=args.prompt + 4 + args.steps + 4) for v, m in models.items()}
    prompts = [[(7 * i + 3 * j) % models["after"].config.vocab_size for j in range(args.prompt)] for i in range(8)]
    for mode, b in DECODE:
        with ops.use_kernels(mode):
            times = {v: [] for v in VARIANTS}
            for v in VARIANTS:
                _step_s(engines[v], prompts[:b], args.steps)  # warm
            for trial in range(args.trials):
                for v in (VARIANTS if trial % 2 == 0 else VARIANTS[::-1]):
                    times[v].append(_step_s(engines[v], prompts[:b], args.steps))
        ratio = statistics.median(a / z for a, z in zip(times["after"], times["before"]))
        print(f"{mode} batch {b}: step after {1e3 * statistics.median(times['after']):.1f} ms, before "
              f"{1e3 * statistics.median(times['before']):.1f} ms, after/before {ratio:.3f} (median of {args.trials} paired)",
              flush=True)


def run_case(args, cache_dir: str, usual: bool) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--threads", str(args.threads),
           "--batch", str(args.batch), "--prompt", str(args.prompt), "--steps", str(args.steps), "--trials", str(args.trials)]
    proc = subprocess.run(cmd + (["--usual"] if usual else []), env={**os.environ, "NEMO_RZ_CACHE_DIR": cache_dir},
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="a Hugging Face checkpoint directory")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    ap.add_argument("--batch", type=int, default=4, help="prompts in the first forward")
    ap.add_argument("--prompt", type=int, default=8, help="tokens per prompt")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per trial")
    ap.add_argument("--trials", type=int, default=3, help="trials per decode case (median)")
    ap.add_argument("--usual", action="store_true", help="child: the 'before' variant, contiguous [N, K] weights")
    ap.add_argument("--decode-ab", action="store_true", help="only the decode steps, both variants in one process, interleaved")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child or args.decode_ab:
        (child if args.child else decode_ab)(args)
        return
    print(f"threads {args.threads}  cpus {os.cpu_count()}  load average {os.getloadavg()[0]:.1f}  model {args.model}", flush=True)
    cols = ["maxrss_mb", "rss_mb", "first_cpu"] + [f"{m}_b{b}_ms" for m, b in DECODE]
    with tempfile.TemporaryDirectory(prefix="nemo-rz-layout-") as cache:
        run_case(args, cache, usual=False)  # fills the probe cache and builds the C++ kernels (not counted)
        results = {v: [] for v in VARIANTS}
        for rep in range(args.reps):
            for v in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
                r = run_case(args, cache, usual=v == "before")
                results[v].append(r)
                print(f"rep {rep + 1} {v}: " + " ".join(f"{c} {r[c]:.3f}" for c in cols), flush=True)
    print("\n| variant | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for v in VARIANTS:
        print(f"| {v} | " + " | ".join(f"{statistics.median(r[c] for r in results[v]):.3f}" for c in cols) + " |")
    ratios = {c: statistics.median(a[c] / b[c] for a, b in zip(results["after"], results["before"])) for c in cols}
    print("\nafter/before (median of paired ratios): " + ", ".join(f"{c} {x:.3f}" for c, x in ratios.items()))


if __name__ == "__main__":
    main()
