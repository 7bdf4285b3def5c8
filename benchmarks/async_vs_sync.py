"""Step throughput of asynchronous vs synchronous training: the same work (updates, batch, model) with
algo.max_lag=0 (generate, then train, alternately) and algo.max_lag>=2 (rollout overlaps training).

Each run is a fresh child process that builds `nemo_rz.runtime.trainer.Trainer` in-process (local back-end:
one rollout worker process, the learner in the child), with eval, checkpoints, the decomposition and
TensorBoard off so that the loop does only rollout + training. The child wraps `Trainer._update` to add two
fields to each metrics row: `bench_tokens` (generated tokens of the batch) and `bench_rollout_s` (the worker's
own generation time for the batch, which is tokens / rollout_tokens_per_s).

Per run, over the rows after --skip warm-up updates:
  updates/s   (rows - 1) / (elapsed_s[last] - elapsed_s[first])
  R           median rollout seconds per batch  = tokens / rollout_tokens_per_s
  T           median learner seconds per update = tokens / learner_tokens_per_s
  ideal       (R + T) / max(R, T): the speed-up of perfect overlap over strict alternation
The async/sync ratio is taken within one repetition (runs of a repetition are back to back, the order rotates
every repetition so that load from other tenants hits both alike); the table reports the median over
repetitions. The ideal is computed from the SYNC run's R and T (phases measured without overlap, so without
the two processes competing for the CPU); the ideal from the async run's own R and T is printed beside it.

Run with the glibc malloc settings from the README (set for the children here if absent):

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
        python benchmarks/async_vs_sync.py                 # default balanced workload, 3 repetitions
    python benchmarks/async_vs_sync.py --quick             # smoke run (< 1 minute)
    python benchmarks/async_vs_sync.py -- algo.prompts_per_update=32   # extra overrides after --
    python benchmarks/async_vs_sync.py --config smollm2_arith --updates 10 --skip 2 --lags 0,1
        # a preset's own workload (SmolLM2-135M; only the one-thread split and TIMING are added)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296", "MALLOC_TOP_PAD_": "268435456"}

# Timing runs: only rollout + training in the loop.
TIMING = [
    "eval.every=0", "checkpoint.every=0", "metrics.decomposition_every=0", "metrics.tensorboard=false",
    "progress=false",
]
# The balanced workload (see RESULTS.md for how it was chosen): one rollout worker with one thread and a
# learner with one thread (the natural split of 2 cores); the batch is small enough that the per-token decode
# steps of the rollout cost about as much as the learner's forward + backward over the whole batch.
SPLIT = ["runtime.rollout_workers=1", "runtime.worker_threads=1", "runtime.learner_threads=1"]
WORKLOAD = [*SPLIT, "algo.prompts_per_update=8", "algo.group_size=8", "algo.max_new_tokens=6", "warmup.steps=100"]


def child(run_dir: str, overrides: list[str], preset: str | None = None) -> None:
    from nemo_rz import config
    from nemo_rz.runtime.trainer import Trainer

    class TimedTrainer(Trainer):
        def _update(self, res):
            record = super()._update(res)
            record["bench_tokens"] = res.tokens
            record["bench_rollout_s"] = res.seconds
            return record

    cfg = config.load(preset, overrides)
    cfg.run_dir = run_dir
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    summary = TimedTrainer(cfg, Path(run_dir), log=lambda *a: None).run()
    (Path(run_dir) / "summary.json").write_text(json.dumps(summary, indent=2))


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / hz, sum(fields[:8]) / hz


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)  # children and their reaped rollout workers
    return r.ru_utime + r.ru_stime


def wait_idle(max_wait: float, busy_below: float = 0.15, probe: float = 3.0) -> float:
    """Wait (at most max_wait s) until the machine is almost idle for `probe` s; returns its busy cores."""
    deadline = time.time() + max_wait
    while True:
        b0, _ = cpu_times()
        time.sleep(probe)
        busy = (cpu_times()[0] - b0) / probe
        if busy < busy_below or time.time() >= deadline:
            return busy


def run_one(lag: int, args, extra: list[str], base: Path, tag: str) -> dict:
    run_dir = base / tag
    overrides = [*(SPLIT if args.config else WORKLOAD), *TIMING, f"algo.updates={args.updates}", f"algo.max_lag={lag}",
                 f"seed={args.seed}", *extra]
    env = {**os.environ}
    for k, v in MALLOC.items():
        env.setdefault(k, v)
    discarded = []
    for attempt in range(args.attempts):
        idle_before = wait_idle(args.wait_idle) if args.wait_idle else None
        load_before = os.getloadavg()
        busy0, own0 = cpu_times()[0], own_cpu()
        start = time.time()
        attempt_dir = run_dir.with_name(f"{run_dir.name}-a{attempt}")
        proc = subprocess.run([sys.executable, __file__, "--child", str(attempt_dir), args.config or "", *overrides], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.time() - start
        own = own_cpu() - own0
        others = max(0.0, cpu_times()[0] - busy0 - own) / wall  # cores used by other tenants during the run
        if proc.returncode != 0:
            raise SystemExit(f"run {tag} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
        if others <= args.max_others or attempt == args.attempts - 1:
            break
        discarded.append(dict(attempt=attempt, others_cores=others, wall_s=wall))
        print(f"    ({tag}: other tenants used {others:.2f} cores during the run; repeating)", flush=True)
    run_dir = attempt_dir
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    win = rows[args.skip:]
    if len(win) < 5:
        raise SystemExit(f"--updates {args.updates} leaves {len(win)} rows after --skip {args.skip}; raise --updates")
    span = win[-1]["elapsed_s"] - win[0]["elapsed_s"]
    steps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(win, win[1:])]
    R = statistics.median(r["bench_rollout_s"] for r in win)
    T = statistics.median(r["bench_tokens"] / r["learner_tokens_per_s"] for r in win)
    return dict(
        lag=lag, tag=tag, updates_per_s=(len(win) - 1) / span, median_step_s=statistics.median(steps),
        R_s=R, T_s=T, ideal=(R + T) / max(R, T), tokens_per_batch=statistics.median(r["bench_tokens"] for r in win),
        queue_wait_s=statistics.median(r["queue_wait_s"] for r in win), lag_hist=sorted({r["lag"] for r in win}),
        reward_last=statistics.mean(r["reward"] for r in win[-10:]), wall_s=wall,
        load_before=load_before[0], load_after=os.getloadavg()[0], own_cpu_s=own, others_cores=others,
        busy_cores_before=idle_before, attempts=len(discarded) + 1, discarded=discarded,
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1], argv[3:], argv[2] or None)
        return 0
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=200, help="updates per run (the same for every run)")
    ap.add_argument("--skip", type=int, default=40, help="first updates left out of the timing (warm-up)")
    ap.add_argument("--lags", default="0,2", help="comma list of algo.max_lag values; 0 is the sync reference")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; variants interleaved, order rotated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", help="a preset or YAML (e.g. smollm2_arith): its workload instead of the balanced one")
    ap.add_argument("--quick", action="store_true", help="smoke run: 60 updates, 1 repetition")
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="before each run wait up to this many seconds for the machine to be idle (other tenants)")
    ap.add_argument("--max-others", type=float, default=9.0,
                    help="repeat a run when other tenants used more than this many cores during it")
    ap.add_argument("--quiet", type=float, default=0.25, help="runs with other tenants <= this many cores count as quiet")
    ap.add_argument("--attempts", type=int, default=1, help="at most this many tries per run (see --max-others)")
    ap.add_argument("--out", default="benchmarks/plots/async_vs_sync.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.updates, args.skip, args.reps = 60, 15, 1
    lags = [int(x) for x in args.lags.split(",")]
    if 0 not in lags or len(lags) < 2:
        raise SystemExit("--lags must include 0 (the synchronous reference) and at least one max_lag >= 1")
    base = Path(tempfile.mkdtemp(prefix="async_vs_sync-"))
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {platform.node()}  cpus={os.cpu_count()}  "
          f"load={os.getloadavg()}  runs under {base}")
    import nemo_rz

    print(f"# nemo_rz from {Path(nemo_rz.__file__).parent}")
    print(f"# workload: {' '.join(WORKLOAD + extra)}  updates={args.updates} skip={args.skip}")
    runs = []
    for rep in range(args.reps):
        order = lags[rep % len(lags):] + lags[: rep % len(lags)]
        for lag in order:
            r = run_one(lag, args, extra, base, f"rep{rep}-lag{lag}")
            r["rep"] = rep
            runs.append(r)
            print(f"  rep {rep} max_lag {lag}: {r['updates_per_s']:.2f} upd/s  R {1e3 * r['R_s']:.0f} ms  "
                  f"T {1e3 * r['T_s']:.0f} ms  ideal {r['ideal']:.2f}  load {r['load_before']:.1f}->{r['load_after']:.1f}  "
                  f"others {r['others_cores']:.2f} cores  own cpu {r['own_cpu_s']:.0f}s/{r['wall_s']:.0f}s", flush=True)
    # Paired ratios within each repetition.
    table = []
    sync = {r["rep"]: r for r in runs if r["lag"] == 0}
    for lag in lags:
        mine = [r for r in runs if r["lag"] == lag]
        ratios = [r["updates_per_s"] / sync[r["rep"]]["updates_per_s"] for r in mine]
        ideal_sync = [sync[r["rep"]]["ideal"] for r in mine]
        table.append(dict(
            max_lag=lag, updates_per_s=statistics.median(r["updates_per_s"] for r in mine),
            median_step_ms=1e3 * statistics.median(r["median_step_s"] for r in mine),
            R_ms=1e3 * statistics.median(r["R_s"] for r in mine), T_ms=1e3 * statistics.median(r["T_s"] for r in mine),
            ratio=statistics.median(ratios), ratios=ratios,
            ideal_from_sync_phases=statistics.median(ideal_sync),
            ideal_from_own_phases=statistics.median(r["ideal"] for r in mine),
            ratio_over_ideal=statistics.median(a / b for a, b in zip(ratios, ideal_sync)),
            queue_wait_ms=1e3 * statistics.median(r["queue_wait_s"] for r in mine),
            load=statistics.median(r["load_before"] for r in mine),
            others_cores=statistics.median(r["others_cores"] for r in mine),
        ))
    print()
    print("| max_lag | updates/s | median step ms | R ms (rollout/batch) | T ms (learner/update) | async/sync | "
          "ideal (R+T)/max(R,T), sync phases | ideal, own phases | measured/ideal | queue wait ms | other tenants (cores) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['max_lag']} | {t['updates_per_s']:.2f} | {t['median_step_ms']:.0f} | {t['R_ms']:.0f} | {t['T_ms']:.0f} | "
              f"{t['ratio']:.2f}x ({', '.join(f'{x:.2f}' for x in t['ratios'])}) | {t['ideal_from_sync_phases']:.2f}x | "
              f"{t['ideal_from_own_phases']:.2f}x | {'—' if t['max_lag'] == 0 else format(t['ratio_over_ideal'], '.2f')} | "
              f"{t['queue_wait_ms']:.0f} | {t['others_cores']:.2f} |")
    # Only runs during which other tenants used at most --quiet cores (pairing across repetitions).
    quiet = {lag: [r for r in runs if r["lag"] == lag and r["others_cores"] <= args.quiet] for lag in lags}
    quiet_table = []
    if quiet[0]:
        s_ups = statistics.median(r["updates_per_s"] for r in quiet[0])
        s_ideal = statistics.median(r["ideal"] for r in quiet[0])
        print(f"\nquiet runs only (other tenants <= {args.quiet} cores during the run):")
        print("| max_lag | quiet runs | updates/s | R ms | T ms | async/sync | ideal, sync phases | measured/ideal |")
        print("|---|---|---|---|---|---|---|---|")
        for lag in lags:
            q = quiet[lag]
            if not q:
                print(f"| {lag} | 0 | n/a | | | | | |")
                continue
            ups = statistics.median(r["updates_per_s"] for r in q)
            row = dict(max_lag=lag, runs=len(q), updates_per_s=ups, R_ms=1e3 * statistics.median(r["R_s"] for r in q),
                       T_ms=1e3 * statistics.median(r["T_s"] for r in q), ratio=ups / s_ups, ideal_from_sync_phases=s_ideal,
                       ratio_over_ideal=ups / s_ups / s_ideal)
            quiet_table.append(row)
            print(f"| {lag} | {len(q)} | {ups:.2f} | {row['R_ms']:.0f} | {row['T_ms']:.0f} | {row['ratio']:.2f}x | {s_ideal:.2f}x | "
                  f"{'—' if lag == 0 else format(row['ratio_over_ideal'], '.2f')} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(), cpus=os.cpu_count(),
        argv=sys.argv, workload=WORKLOAD + extra, timing=TIMING, updates=args.updates, skip=args.skip,
        reps=args.reps, table=table, quiet=args.quiet, quiet_table=quiet_table, runs=runs,
    ), indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
