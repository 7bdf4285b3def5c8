"""Start-up cost of a rollout process: from process start to its first forward, with the route probes' results on
disk (warm: ops/probe_cache.py) or not (cold: NEMO_RZ_PROBE_CACHE=0, every shape probed, as every process did
before the cache; the same NEMO_RZ_CACHE_DIR, so what else is kept there, the C++ kernels' build, is warm in both).

Each repetition starts a fresh interpreter per case (cold and warm alternate which goes first), which loads a
checkpoint with `load_hf` and runs its first RolloutEngine.generate (a prefill of --batch prompts of --prompt
tokens, then one decode step, logprobs and sampling included), then the same call again (steady state). Reported
(medians, wall and process CPU seconds): import, model load, first forward, steady forward, first - steady
(start-up overhead), of which probes (time inside ops.verified.verified: probing cold, reading and checking warm)
and other (first-use work besides: weight copies where a route still makes one, fresh memory), and process start
to first forward done.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/startup.py --model models/smollm2-135m-instruct --reps 3
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CASES = ("cold", "warm")
TARGET_S = 0.3  # the target for the first forward with a warm cache


def child(args) -> None:
    """One fresh process: time its phases and print them as one JSON line."""
    marks = {"started": time.time()}
    import torch

    from nemo_rz.generation import RolloutEngine, SamplingParams
    from nemo_rz.models.hf import load_hf
    from nemo_rz.ops import verified

    marks["imported"] = time.time()
    torch.set_num_threads(args.threads)
    model = load_hf(args.model)
    marks["loaded"] = time.time()
    probe_s = [0.0, 0.0]  # wall, CPU
    inner = verified.verified

    def timed(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        try:
            return inner(*a, **k)
        finally:
            probe_s[0] += time.perf_counter() - t
            probe_s[1] += time.process_time() - c

    for module in list(sys.modules.values()):  # every module that calls verified() (the routes look it up at each call)
        if module is not None and module.__name__.startswith("nemo_rz.") and getattr(module, "verified", None) is inner:
            module.verified = timed
    engine = RolloutEngine(model, max_batch_size=args.batch, max_model_len=args.prompt + 8)
    prompts = [[(7 * i + 3 * j) % model.config.vocab_size for j in range(args.prompt)] for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=2, seed=0)
    c = time.process_time()
    engine.generate(prompts, params)
    marks["first"], first_cpu, first_probes = time.time(), time.process_time() - c, list(probe_s)
    t, c = time.time(), time.process_time()
    engine.generate(prompts, params)
    steady, steady_cpu = time.time() - t, time.process_time() - c
    print(json.dumps({"marks": marks, "steady": steady, "probes": first_probes[0], "first_cpu": first_cpu,
                      "steady_cpu": steady_cpu, "probes_cpu": first_probes[1]}), flush=True)


def run_case(args, cache_dir: str, cold: bool) -> dict:
    env = {**os.environ, "NEMO_RZ_CACHE_DIR": cache_dir, "NEMO_RZ_PROBE_CACHE": "0" if cold else "1"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", args.model, "--threads", str(args.threads),
           "--batch", str(args.batch), "--prompt", str(args.prompt)]
    spawned = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    m = got["marks"]
    wall = {"interpreter": m["started"] - spawned, "import": m["imported"] - m["started"], "load": m["loaded"] - m["imported"],
            "first": m["first"] - m["loaded"], "steady": got["steady"], "probes": got["probes"], "to_first": m["first"] - spawned}
    cpu = {"first": got["first_cpu"], "steady": got["steady_cpu"], "probes": got["probes_cpu"]}
    for times in (wall, cpu):
        times["overhead"] = times["first"] - times["steady"]
        times["other"] = times["overhead"] - times["probes"]
    return {"wall": wall, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct", help="a Hugging Face checkpoint directory")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each process (probes run on one anyway)")
    ap.add_argument("--batch", type=int, default=4, help="prompts in the first forward")
    ap.add_argument("--prompt", type=int, default=8, help="tokens per prompt")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import torch

    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {args.threads}  cpus {os.cpu_count()}  "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"model {args.model}; first forward: prefill {args.batch} x {args.prompt} tokens, one decode step", flush=True)
    with tempfile.TemporaryDirectory(prefix="nemo-rz-startup-") as root:
        warm_dir = os.path.join(root, "warm")
        run_case(args, warm_dir, cold=False)  # fills the warm cache, and builds what else is built once (not timed)
        results = {c: [] for c in CASES}
        for rep in range(args.reps):
            for case in (CASES if rep % 2 == 0 else CASES[::-1]):
                r = run_case(args, warm_dir, cold=case == "cold")
                results[case].append(r)
                w, c = r["wall"], r["cpu"]
                print(f"rep {rep + 1} {case}: load {w['load']:.2f}s first forward {w['first']:.2f}s ({c['first']:.2f}s CPU, "
                      f"probes {c['probes']:.2f}s CPU) steady {w['steady']:.2f}s ({c['steady']:.2f}s CPU)", flush=True)
    for clock, cols in (("wall", ("interpreter", "import", "load", "first", "steady", "overhead", "probes", "other", "to_first")),
                        ("cpu", ("first", "steady", "overhead", "probes", "other"))):
        print(f"\n{clock} seconds (median)\n| cache | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
        for case in CASES:
            print(f"| {case} | " + " | ".join(f"{statistics.median(r[clock][c] for r in results[case]):.3f}" for c in cols) + " |")

    def paired(clock, col):
        return statistics.median(c[clock][col] / w[clock][col] for c, w in zip(results["cold"], results["warm"]))

    def warm(clock, col):
        return statistics.median(r[clock][col] for r in results["warm"])

    print(f"\ncold/warm (median paired, CPU): first forward {paired('cpu', 'first'):.1f}x, probes {paired('cpu', 'probes'):.1f}x")
    print(f"warm first forward {warm('wall', 'first'):.3f}s wall, {warm('cpu', 'first'):.3f}s CPU (start-up overhead "
          f"{warm('cpu', 'overhead'):.3f}s CPU, of which probes {warm('cpu', 'probes'):.3f}s); "
          f"target < {TARGET_S}s: {'MET' if warm('wall', 'first') < TARGET_S else 'MISSED'}")


if __name__ == "__main__":
    main()
