"""nemo-rz vs TRL's GRPOTrainer on the SmolLM2 recipe (conf/smollm2_arith.yaml), side by side in one interleaved run.

The same job on both sides: SmolLM2-135M-Instruct (model.hf_path), float32, CPU, task add2 with its chat prompts,
4 prompts x 8 samples per update, 16 new tokens, temperature 1, lr 1e-5 (constant), grad clip 1.0, no reference
model (TRL beta 0). The prompts are nemo-rz's own: a short child builds nemo-rz's Trainer once and writes
Trainer.job(u) (prompt ids, answers) for every update, so TRL trains on batch u's very prompt ids (checked: TRL's
tokenizer gives them back from the rendered text) and scores its completions with nemo-rz's task.reward (the last
number of the reply, 0 without <|im_end|>).

  nemo-rz   python -m nemo_rz.train --config smollm2_arith algo.updates=N + TIMING (below): its own 2-process loop
            (rollout worker + learner, max_lag 1, one thread each), the recipe's settings otherwise.
  TRL       GRPOTrainer (trl 1.16): per_device_train_batch_size = generation_batch_size = 32, num_generations 8,
            gradient_accumulation_steps 1, so one optimizer step is one generation of 32 completions of 4 prompts;
            transformers generate (no vLLM), beta 0, bf16 off, gradient checkpointing off (TRL's default is on:
            --trl-gradient-checkpointing), torch's default threads (both cores; --trl-threads), no eval, no saving.
Held-out eval: TRL has none by default, so nemo-rz's is cut to eval.every=0 eval.n=1 (one greedy prompt at the start
and the end, outside the timed updates); the recipe's kernel/lag decomposition (an extra learner forward every 5th
update), checkpoints, TensorBoard and the progress bar are off as well.

Each run is a fresh child; rounds alternate TRL, nemo-rz (--rounds). Per run, over updates 2..N (update 1 is
warm-up): s/update = the median gap between consecutive update ends (nemo-rz: metrics.jsonl elapsed_s; TRL: a
callback's on_step_end), updates/s = 1 / that. The ratio nemo/TRL is taken within a round, the table gives the
median; "cores it got" is the child's CPU seconds over its wall time (startup included). Peak memory: the child's
process tree (the trainer and its rollout worker) sampled every 0.2 s, sum of RSS and of PSS (shared pages counted
once), and ru_maxrss of the largest single process.

The 2-core work limit: one nemo-rz run with algo.max_lag=0 and one thread per side (--sync-runs) gives the
single-thread phase times R1 (rollout_s) and T1 (learn_s), measured without overlap; (R1 + T1) / 2 is the
s/update of two cores that share all the work perfectly, the floor for any split of it.

    pip install -e ".[hf,bench]"                         # transformers and TRL 1.16
    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \
        python benchmarks/vs_trl.py                      # 6 updates per run, 2 rounds, one sync run
    python benchmarks/vs_trl.py --quick                  # smoke run: 2 updates, 1 round
    python benchmarks/vs_trl.py -- kernels=fast          # extra nemo-rz overrides after -- (nemo-rz side only)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296", "MALLOC_TOP_PAD_": "268435456"}
CONFIG = "smollm2_arith"
# nemo-rz with only rollout + training in its loop (what TRL's loop does by default).
TIMING = ["eval.every=0", "eval.n=1", "checkpoint.every=0", "metrics.decomposition_every=0", "metrics.tensorboard=false",
          "progress=false"]
SYNC = ["algo.max_lag=0", "runtime.learner_threads=1", "runtime.worker_threads=1"]  # single-thread phase times


# -- children --------------------------------------------------------------------------------------------------
def prompts_child(out: str, updates: int, overrides: list[str]) -> None:
    """Write nemo-rz's batches 0..updates-1 (one entry per prompt, not per sample) as JSON."""
    from nemo_rz import config
    from nemo_rz.runtime.trainer import Trainer

    cfg = config.load(CONFIG, overrides)
    run_dir = Path(tempfile.mkdtemp(prefix="vs_trl-prompts-"))
    trainer = Trainer(cfg, run_dir, log=lambda *a: None)
    g = cfg.algo.group_size
    batches = []
    for u in range(updates):
        job = trainer.job(u)
        answers = getattr(job, "answers", None) or trainer.answers(u)  # Job.answers, or Trainer.answers(u) before it
        batches.append(dict(batch=u, prompts=job.prompts[::g], answers=answers[::g], stop_token_ids=list(job.stop_token_ids)))
    Path(out).write_text(json.dumps(dict(group_size=g, batches=batches)))


def trl_child(batches_file: str, out: str, overrides: list[str], gradient_checkpointing: bool, threads: int) -> None:
    """TRL's GRPOTrainer on nemo-rz's batches; writes per-step end times and what each step generated and trained."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    try:
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        sys.exit('vs_trl.py needs TRL: pip install -e ".[hf,bench]"')

    from nemo_rz import config
    from nemo_rz.tasks import make_task

    if threads:
        torch.set_num_threads(threads)
    cfg = config.load(CONFIG, overrides)
    a, path = cfg.algo, cfg.model.hf_path
    data = json.loads(Path(batches_file).read_text())
    tok = AutoTokenizer.from_pretrained(path)
    rows = []
    for b in data["batches"]:
        for ids, answer in zip(b["prompts"], b["answers"]):
            text = tok.decode(ids, skip_special_tokens=False)
            back = tok(text=[text])["input_ids"][0]  # as GRPOTrainer._tokenize_prompts tokenizes a text prompt
            if list(back) != list(ids):
                raise SystemExit(f"batch {b['batch']}: TRL's tokenizer does not give nemo-rz's prompt ids back from {text!r}")
            rows.append(dict(prompt=text, answer=answer, batch=b["batch"]))
    task = make_task(cfg.task.name, tokenizer=cfg.model.tokenizer or path, **dict(cfg.task.options),
                     chat_template=cfg.task.chat_template, system_prompt=cfg.task.system_prompt)

    def add2_reward(prompts, completions, completion_ids, answer, **_):
        return [task.reward(ids, ans) for ids, ans in zip(completion_ids, answer)]

    class Recorded(GRPOTrainer):
        """Records, per generation, its seconds (generate + score), tokens and the batches its prompts came from."""
        log_rows: list = []

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            res = super()._generate_and_score_completions(inputs)
            pm, cm = res["prompt_mask"], res["completion_mask"]
            self.log_rows.append(dict(
                rollout_s=time.perf_counter() - start, batches=sorted({x["batch"] for x in inputs}),
                distinct_prompts=len({x["prompt"] for x in inputs}), generated_tokens=int(cm.sum()),
                prompt_tokens=int(pm.sum()), learner_shape=[int(pm.shape[0]), int(pm.shape[1] + cm.shape[1])]))
            return res

    class Clock(TrainerCallback):
        def __init__(self):
            self.begin, self.ends = None, []

        def on_train_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    n = a.prompts_per_update * a.group_size
    args = GRPOConfig(
        output_dir=str(Path(out).parent / "trl-out"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=a.group_size, generation_batch_size=n, num_iterations=1, max_completion_length=a.max_new_tokens,
        temperature=a.temperature, top_p=1.0, top_k=0, learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=a.grad_clip, beta=0.0, bf16=False, fp16=False, use_cpu=True,
        gradient_checkpointing=gradient_checkpointing, max_steps=len(data["batches"]), shuffle_dataset=False,
        seed=cfg.seed, logging_steps=1, report_to="none", save_strategy="no", eval_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clock = Clock()
    trainer = Recorded(model=model, reward_funcs=add2_reward, args=args, train_dataset=Dataset.from_list(rows),
                       processing_class=tok, callbacks=[clock])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    Path(out).write_text(json.dumps(dict(
        begin=clock.begin, ends=clock.ends, steps=trainer.log_rows, rewards=rewards, threads=torch.get_num_threads(),
        eos_token_ids=list(trainer.eos_token_ids), nemo_stop_token_ids=data["batches"][0]["stop_token_ids"],
    )))


# -- measuring a child -----------------------------------------------------------------------------------------
def _tree(root: int) -> list[int]:
    """root and all its descendants (from /proc/*/stat)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _rss_pss(pid: int) -> tuple[int, int]:
    """(RSS, PSS) bytes of one process; (0, 0) once it is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


def cpu_busy() -> float:
    """Busy CPU seconds of the whole machine (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def measure(cmd: list[str], log: Path, env: dict) -> dict:
    """Run cmd; its wall time, exit code, peak tree RSS/PSS, largest ru_maxrss and the cores other tenants used."""
    peak = {"rss": 0, "pss": 0}
    busy0, start = cpu_busy(), time.time()
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def sample():
            while not done.wait(0.2):
                sizes = [_rss_pss(p) for p in _tree(proc.pid)]
                peak["rss"] = max(peak["rss"], sum(s[0] for s in sizes))
                peak["pss"] = max(peak["pss"], sum(s[1] for s in sizes))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        sampler.join()
    wall = time.time() - start
    own = usage.ru_utime + usage.ru_stime
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); last lines of {log}:\n"
                         + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return dict(wall_s=wall, own_cpu_s=own, cores_got=own / wall, others_cores=max(0.0, cpu_busy() - busy0 - own) / wall,
                peak_rss_gb=peak["rss"] / 1e9, peak_pss_gb=peak["pss"] / 1e9, max_single_rss_gb=usage.ru_maxrss * 1024 / 1e9)


def _gaps(ends: list[float]) -> list[float]:
    """Seconds of updates 2..N from the update end times (update 1, the warm-up, is left out)."""
    return [b - a for a, b in zip(ends, ends[1:])]


def run_nemo(tag: str, base: Path, args, extra: list[str], env: dict) -> dict:
    run_dir = base / tag
    cmd = [sys.executable, "-m", "nemo_rz.train", "--config", CONFIG, f"algo.updates={args.updates}", *TIMING,
           f"run_dir={run_dir}", *extra]
    m = measure(cmd, base / f"{tag}.log", env)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed, gaps = rows[1:], _gaps([r["elapsed_s"] for r in rows])
    step = statistics.median(gaps)
    return dict(
        side="nemo-rz", tag=tag, s_per_update=step, updates_per_s=1 / step, gaps_s=gaps,
        rollout_s=statistics.median(r["rollout_s"] for r in timed), learn_s=statistics.median(r["learn_s"] for r in timed),
        queue_wait_s=statistics.median(r["queue_wait_s"] for r in timed),
        generated_tokens=statistics.median(r["tokens"] for r in timed), reward=statistics.mean(r["reward"] for r in rows),
        lags=sorted({r["lag"] for r in rows}), **m)


def run_trl(tag: str, base: Path, args, batches: Path, env: dict) -> dict:
    out = base / f"{tag}.json"
    cmd = [sys.executable, __file__, "--trl-child", str(batches), str(out), str(int(args.trl_gradient_checkpointing)),
           str(args.trl_threads)]
    m = measure(cmd, base / f"{tag}.log", env)
    r = json.loads(out.read_text())
    steps = r["steps"]
    if len(steps) != args.updates or len(r["ends"]) != args.updates:
        raise SystemExit(f"{tag}: TRL made {len(steps)} generations and {len(r['ends'])} optimizer steps, expected "
                         f"{args.updates} of each (one generation per step); see {base / (tag + '.log')}")
    same = all(s["batches"] == [u] and s["distinct_prompts"] == args.prompts for u, s in enumerate(steps))
    gaps = _gaps(r["ends"])
    step = statistics.median(gaps)
    rollout = statistics.median(s["rollout_s"] for s in steps[1:])
    return dict(
        side="TRL", tag=tag, s_per_update=step, updates_per_s=1 / step, gaps_s=gaps, rollout_s=rollout,
        learn_s=statistics.median(b - a - s["rollout_s"] for a, b, s in zip(r["ends"], r["ends"][1:], steps[1:])),
        generated_tokens=statistics.median(s["generated_tokens"] for s in steps[1:]),
        learner_positions=statistics.median(s["learner_shape"][0] * s["learner_shape"][1] for s in steps[1:]),
        learner_real_tokens=statistics.median(s["prompt_tokens"] + s["generated_tokens"] for s in steps[1:]),
        reward=statistics.mean(r["rewards"]) if r["rewards"] else None, threads=r["threads"], same_batches_as_nemo=same,
        eos_token_ids=r["eos_token_ids"], nemo_stop_token_ids=r["nemo_stop_token_ids"], **m)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--prompts-child":
        prompts_child(argv[1], int(argv[2]), argv[3:])
        return 0
    if argv and argv[0] == "--trl-child":
        trl_child(argv[1], argv[2], [], bool(int(argv[3])), int(argv[4]))
        return 0
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=6, help="updates per run; the first is warm-up, left out of the timing")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (TRL, nemo-rz), interleaved")
    ap.add_argument("--sync-runs", type=int, default=1, help="nemo-rz runs with max_lag 0, one thread per side: R1, T1")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 updates, 1 round")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL with its default gradient checkpointing (one more forward per update)")
    ap.add_argument("--trl-threads", type=int, default=0, help="torch threads of the TRL process (0: torch's default, every core)")
    ap.add_argument("--out", default="benchmarks/plots/vs_trl.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.updates, args.rounds = 2, 1
    if args.updates < 2:
        raise SystemExit(f"--updates {args.updates}: need at least 2 (the first is warm-up, left out of the timing)")
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in MALLOC.items()}}
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    base = Path(tempfile.mkdtemp(prefix="vs_trl-"))
    print(f"# {datetime.datetime.now().isoformat(timespec='seconds')}  {platform.node()}  cpus={os.cpu_count()}  "
          f"load={tuple(round(x, 2) for x in os.getloadavg())}  runs under {base}", flush=True)
    print(f"# updates={args.updates} (1 warm-up)  rounds={args.rounds}  nemo-rz: --config {CONFIG} {' '.join(TIMING + extra)}",
          flush=True)

    batches = base / "batches.json"
    measure([sys.executable, __file__, "--prompts-child", str(batches), str(args.updates), *TIMING], base / "prompts.log", env)
    data = json.loads(batches.read_text())
    args.prompts = len(data["batches"][0]["prompts"])
    runs = []
    for rnd in range(args.rounds):
        for side in ("TRL", "nemo-rz"):
            tag = f"r{rnd}-{'trl' if side == 'TRL' else 'nemo'}"
            r = run_trl(tag, base, args, batches, env) if side == "TRL" else run_nemo(tag, base, args, extra, env)
            r["round"] = rnd
            runs.append(r)
            print(f"  round {rnd} {side:7s}: {r['s_per_update']:.1f} s/update (gaps {', '.join(f'{g:.1f}' for g in r['gaps_s'])})  "
                  f"rollout {r['rollout_s']:.1f} s  learn {r['learn_s']:.1f} s  peak RSS {r['peak_rss_gb']:.2f} GB "
                  f"(PSS {r['peak_pss_gb']:.2f})  others {r['others_cores']:.2f} cores  wall {r['wall_s']:.0f} s", flush=True)
    sync = []
    for i in range(args.sync_runs):
        r = run_nemo(f"sync{i}", base, args, [*extra, *SYNC], env)
        sync.append(r)
        print(f"  sync run {i}: R1 {r['rollout_s']:.1f} s  T1 {r['learn_s']:.1f} s  ({r['s_per_update']:.1f} s/update)  "
              f"others {r['others_cores']:.2f} cores", flush=True)

    def med(side, key):
        vals = [r[key] for r in runs if r["side"] == side and r.get(key) is not None]
        return statistics.median(vals) if vals else None

    ratios = []
    for rnd in range(args.rounds):
        t, n = (next(r for r in runs if r["round"] == rnd and r["side"] == s) for s in ("TRL", "nemo-rz"))
        ratios.append(n["updates_per_s"] / t["updates_per_s"])
    trl_s, nemo_s = med("TRL", "s_per_update"), med("nemo-rz", "s_per_update")
    limit = None
    if sync:
        r1, t1 = statistics.median(r["rollout_s"] for r in sync), statistics.median(r["learn_s"] for r in sync)
        limit = dict(R1_s=r1, T1_s=t1, work_limit_s=(r1 + t1) / 2, sync_s_per_update=statistics.median(r["s_per_update"] for r in sync),
                     ratio_at_limit=trl_s / ((r1 + t1) / 2))
    print()
    print("| side | s/update | updates/s | nemo/TRL updates/s | rollout s | learn s | generated tok/update | "
          "peak RSS GB (tree) | peak PSS GB | largest process GB | other tenants (cores) | cores it got |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for side in ("TRL", "nemo-rz"):
        ratio = f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})" if side == "nemo-rz" else "1"
        print(f"| {side} | {med(side, 's_per_update'):.1f} | {1 / med(side, 's_per_update'):.4f} | {ratio} | "
              f"{med(side, 'rollout_s'):.1f} | {med(side, 'learn_s'):.1f} | {med(side, 'generated_tokens'):.0f} | "
              f"{med(side, 'peak_rss_gb'):.2f} | {med(side, 'peak_pss_gb'):.2f} | {med(side, 'max_single_rss_gb'):.2f} | "
              f"{med(side, 'others_cores'):.2f} | {med(side, 'cores_got'):.2f} |")
    if limit:
        print(f"\n2-core work limit (R1 + T1) / 2 = ({limit['R1_s']:.1f} + {limit['T1_s']:.1f}) / 2 = {limit['work_limit_s']:.1f} "
              f"s/update -> at most {limit['ratio_at_limit']:.2f}x TRL's updates/s (sync run: {limit['sync_s_per_update']:.1f} s/update)")
    t0 = next(r for r in runs if r["side"] == "TRL")
    print(f"TRL per update: {med('TRL', 'generated_tokens'):.0f} generated tokens, learner batch {med('TRL', 'learner_positions'):.0f} "
          f"padded positions ({med('TRL', 'learner_real_tokens'):.0f} real), {t0['threads']} torch threads, same batches as nemo-rz: "
          f"{all(r['same_batches_as_nemo'] for r in runs if r['side'] == 'TRL')}, eos {t0['eos_token_ids']} "
          f"(nemo-rz stops at {t0['nemo_stop_token_ids']})")
    longest = max(len(p) for b in data["batches"] for p in b["prompts"])
    print(f"nemo-rz per update: {med('nemo-rz', 'generated_tokens'):.0f} generated tokens, learner batch "
          f"{len(data['batches'][0]['prompts']) * data['group_size']} x ({longest} + the longest completion) positions at most "
          "(right-padded to the batch's longest sequence)")
    print(f"mean reward: TRL {med('TRL', 'reward'):.3f}  nemo-rz {med('nemo-rz', 'reward'):.3f} (sampling differs; not a comparison)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"), host=platform.node(), cpus=os.cpu_count(), argv=sys.argv,
        config=CONFIG, nemo_overrides=TIMING + extra, sync_overrides=SYNC, updates=args.updates, rounds=args.rounds,
        trl_gradient_checkpointing=args.trl_gradient_checkpointing, trl_threads=args.trl_threads,
        ratio=statistics.median(ratios), ratios=ratios,
        trl_s_per_update=trl_s, nemo_s_per_update=nemo_s, work_limit=limit, runs=runs, sync_runs=sync,
    ), indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
