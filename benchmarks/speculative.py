"""Speculative rollouts: acceptance and rollout tokens/s with a co-trained, a frozen and no draft, and the check
that every recorded logprob is still the learner's.

    task   the default job (add2, tiny model): warm up, train a draft offline on the warmed policy's own samples
           (the frozen draft), then run RL with draft.mode=cotrain starting from that draft. Every --every updates
           the policy and the co-trained draft are snapshotted; each snapshot is measured three ways (no draft,
           the frozen draft, the co-trained draft) on the same held-out prompts.
    model  a checkpoint (--model, e.g. models/smollm2-135m-instruct) or a preset shape (benchmarks/shapes.py):
           a draft trained offline on the model's own samples for --draft-updates steps, vs no draft.
    cost   what a speculative step costs at a shape (default SmolLM2-135M's), in plain decode steps, and the
           acceptance that would reach 2x.

Sampling at temperature 1 (full vocabulary), per-request seeds, the same requests for every variant, at each
--batch-sizes (requests in flight). Wall-clock and process CPU time are both reported (CPU time is less
sensitive to neighbours on a shared machine); speed-up = no-draft seconds / draft seconds. "diff" counts
recorded logprobs that differ bitwise from the learner's `token_logprobs` (must be 0).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/speculative.py task --updates 200 --every 50
"""
from __future__ import annotations

import argparse
import datetime
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

from nemo_rz.algorithms.aux_loss import padded  # noqa: E402
from nemo_rz.algorithms.draft import DraftTrainer  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402
from nemo_rz.generation.packing import pack  # noqa: E402
from nemo_rz.generation.speculative import Speculator  # noqa: E402
from nemo_rz.models.draft import DraftHead, from_spec  # noqa: E402


def learner_diff(model, outs) -> int:
    batch = pack(outs)
    with torch.no_grad():
        lp = model.token_logprobs(batch.input_ids, batch.lengths)
    valid = batch.mask.bool()
    return int((lp[valid] != batch.rollout_logprobs[valid]).sum())


def measure(model, draft, k, prompts, max_new, batch_size, seed=7, stop=(), prefix_cache=False, temperature=1.0) -> dict:
    """One timed generate of `prompts` (after an untimed one for warm-up: probes, caches). With `prefix_cache`
    the engines keep their prefix caches as RL workers do (samples of one prompt then share its prefill)."""
    def engine():
        spec = None if draft is None else Speculator(draft, k)
        return RolloutEngine(model, max_batch_size=batch_size, prefix_cache_blocks=4096 if prefix_cache else 0, speculator=spec)

    params = SamplingParams(max_new, temperature=temperature, seed=seed, stop_token_ids=tuple(stop))
    engine().generate(prompts[: max(batch_size, 2)], params)
    eng = engine()
    wall, cpu = time.perf_counter(), time.process_time()
    outs = eng.generate(prompts, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    s = eng.stats
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(tokens=tokens, wall=wall, cpu=cpu, accept=s["spec_accepted"] / max(s["spec_proposed"], 1),
                per_pass=(s["spec_accepted"] + s["spec_verify"]) / max(s["spec_verify"], 1), diff=learner_diff(model, outs))


def samples(model, draft, prompts, max_new, chunk=16, seed=0, stop=(), log=print):
    """The model's own samples of `prompts` at temperature 1 as packed batches of `chunk` completions, each with
    the draft's inputs from one learner forward: (batch, aux features, final hidden states)."""
    engine = RolloutEngine(model, max_batch_size=min(len(prompts), 96))
    outs = engine.generate(prompts, SamplingParams(max_new, temperature=1.0, seed=seed, stop_token_ids=tuple(stop)))
    data = []
    for i in range(0, len(outs), chunk):
        batch = pack(outs[i : i + chunk])
        with draft.tap(model, final=True) as found, torch.no_grad():
            model.token_logprobs(batch.input_ids, batch.lengths)
        data.append((batch, *(padded(x, batch) for x in found[0])))  # the packed forward's rows -> [B * T]
    log(f"  {len(outs)} samples, {sum(len(o.token_ids) for o in outs)} tokens")
    return data


def train_offline(model, draft_trainer, data, updates, held=None, log=print):
    """The draft's own training loop on the model's samples (what co-training does per RL batch, without RL):
    the draft vocabulary from all of `data`'s completions, then `updates` steps visiting its batches in turn;
    with `held`, the estimated acceptance on those batches is logged as training goes."""
    draft_trainer.draft.choose_vocab(torch.cat([b.input_ids[:, 1:][b.mask.bool()] for b, _, _ in data]))
    draft_trainer.vocab_pending = False
    frozen = DraftTrainer(draft_trainer.draft, "frozen", 1.0, 1.0, draft_trainer.steps, draft_trainer.k)
    start = time.time()
    for u in range(updates):
        batch, aux, final = data[u % len(data)]
        m = draft_trainer.step(model, aux, batch.input_ids, batch.mask, 1.0, batch.rollout_logprobs, final=final)
        if u % max(updates // 10, 1) == 0 or u == updates - 1:
            line = f"  offline draft step {u}: loss {m['draft_loss']:.3f} est. accept {m['draft_accept_rate']:.3f}"
            if held:
                est = [frozen.step(model, a, b.input_ids, b.mask, 1.0, b.rollout_logprobs, final=f) for b, a, f in held]
                line += f" | held out {sum(e['draft_accept_rate'] for e in est) / len(est):.3f}"
            log(line + f" ({time.time() - start:.0f} s)")


def table(rows: list[tuple], title: str) -> str:
    out = [title, "",
           "| snapshot | batch | variant | accept | tokens/pass | tokens/s wall | tokens/s CPU | speed-up wall | speed-up CPU | diff |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    base = {}
    for snap, bs, name, r in rows:
        if name == "none":
            base[(snap, bs)] = r
        b = base[(snap, bs)]
        acc = "-" if name == "none" else f"{r['accept']:.2f}"
        per = "1.00" if name == "none" else f"{r['per_pass']:.2f}"
        out.append(f"| {snap} | {bs} | {name} | {acc} | {per} | {r['tokens'] / r['wall']:.0f} | {r['tokens'] / r['cpu']:.0f} | "
                   f"{b['wall'] / r['wall']:.2f}x | {b['cpu'] / r['cpu']:.2f}x | {r['diff']} |")
    return "\n".join(out)


def run_task(args) -> str:

    from nemo_rz import config
    from nemo_rz.models import Decoder
    from nemo_rz.runtime.trainer import Trainer

    run_dir = tempfile.mkdtemp(prefix="spec-bench-")
    overrides = [f"run_dir={run_dir}", "draft.mode=cotrain", f"algo.updates={args.updates}", "eval.every=0",
                 "eval.n=50", "checkpoint.every=0", "progress=false", f"draft.k={args.k}", "metrics.tensorboard=false",
                 f"draft.kind={args.draft_kind}", *args.override]
    cfg = config.load(args.config, overrides)
    trainer = Trainer(cfg, Path(run_dir), log=lambda *a: None)
    rng = random.Random(12345)
    held_out = [trainer.task.encode_prompt(p.prompt) for p in trainer.task.sample(args.prompts, rng)]
    train_prompts = [trainer.task.encode_prompt(p.prompt) for p in trainer.task.sample(64, random.Random(1))]
    max_new, stop = cfg.algo.max_new_tokens, trainer.tok.eos_ids
    print(f"offline draft on the warmed-up policy ({args.draft_updates} steps)")
    offline = DraftTrainer(trainer.draft.draft, "cotrain", cfg.draft.lr, 1.0, cfg.draft.steps, args.k)
    data = samples(trainer.model, offline.draft, train_prompts * 4, max_new, chunk=64, stop=stop)
    train_offline(trainer.model, offline, data, args.draft_updates)
    trainer.draft.vocab_pending = False  # the offline draft chose it
    frozen = from_spec(trainer.model.config, trainer.draft.draft.worker_spec())
    frozen.load_state_dict(trainer.draft.draft.state_dict())
    trainer.history[trainer.version] = trainer.learner.weights(trainer.version)  # version 0 ships the trained draft
    snaps = {0: trainer.history[trainer.version]}
    metrics = []

    def progress(record):
        metrics.append(record)
        if trainer.version % args.every == 0:
            snaps[trainer.version] = trainer.history[trainer.version]

    t0 = time.time()
    trainer.run(progress=progress)
    print(f"RL: {args.updates} updates with co-training in {time.time() - t0:.0f} s")
    rows = []
    for v, bundle in sorted(snaps.items()):
        model = Decoder(trainer.model.config).eval()
        model.load_state_dict(bundle.policy)
        cotrained = from_spec(model.config, frozen.worker_spec())
        cotrained.load_state_dict(bundle.parts["draft"])
        for bs in args.batch_sizes:
            prompts = held_out[: args.prompts if bs > 1 else max(args.prompts // 4, 4)]
            for name, draft in (("none", None), ("frozen", frozen), ("cotrained", cotrained)):
                r = measure(model, draft, args.k, prompts, max_new, bs, stop=stop)
                rows.append((v, bs, name, r))
                print(v, bs, name, {k: round(x, 3) for k, x in r.items()})
    est = [(m["update"], m.get("draft_accept_rate"), m.get("draft_loss")) for m in metrics if m["update"] % args.every == 0]
    lines = ["", "Per-update co-training numbers (estimated on the RL batch): update, acceptance, draft loss: "
             + "; ".join(f"{u}: {a:.2f}, {n:.2f}" for u, a, n in est)]
    title = (f"### Speculative rollouts, default task ({datetime.date.today()}): {args.config or 'tiny model'}, "
             f"draft.kind={args.draft_kind}, k={args.k}, "
             f"max_new_tokens={max_new}, {args.prompts} held-out prompts (batch 1: {max(args.prompts // 4, 4)})")
    return table(rows, title) + "\n".join(lines)


def run_model(args) -> str:
    from nemo_rz.models.draft import load_draft, save_draft
    from nemo_rz.models.hf import load_hf

    with tempfile.TemporaryDirectory() as d:
        model = load_hf(shapes.checkpoint(args, d)).eval()
    if args.weights:  # e.g. the policy of an RL run: its checkpoint's weights in place of the model's own
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(Path(args.weights) / "model.safetensors")))
    torch.manual_seed(0)
    n = args.prompts + args.train_prompts
    vocab, stop = model.config.vocab_size, ()
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(8, 24))] for _ in range(n)]
    if args.model:  # a real model: start from its own text rather than random token soup
        from nemo_rz.tasks import make_task

        task = make_task("add2", tokenizer=args.model, chat_template=True)
        prompts = [task.encode_prompt(p.prompt) for p in task.sample(n, random.Random(3))]
        stop = task.tokenizer.eos_ids
    held_out, train_prompts = prompts[: args.prompts], prompts[args.prompts :]
    held_out = [p for p in held_out for _ in range(args.group)]  # an RL batch: groups of samples per prompt
    if args.load_draft:
        head = load_draft(args.load_draft, model)
        what_draft = f"draft loaded from {args.load_draft}"
    else:
        head = DraftHead(model.config, num_layers=args.draft_layers, vocab_size=args.vocab_size)
        trainer = DraftTrainer(head, "cotrain", args.lr, 1.0, args.steps, args.k)
        print(f"samples for the draft ({len(train_prompts)} prompts)")
        data = samples(model, head, train_prompts, args.max_new_tokens, stop=stop)
        held = samples(model, head, held_out[:16], args.max_new_tokens, seed=99, stop=stop)
        print(f"offline draft ({args.draft_updates} steps)")
        train_offline(model, trainer, data, args.draft_updates, held)
        if args.save_draft:
            save_draft(head, args.save_draft)
        what_draft = (f"{args.draft_layers}-layer draft trained offline for {args.draft_updates} steps on "
                      f"{len(train_prompts)} prompts' samples, vocabulary {head.vocab.numel()}")
    rows = []
    for bs in args.batch_sizes:
        ps = held_out if bs > 1 else held_out[: max(len(held_out) // 4, 4)]
        for name, draft in (("none", None), ("trained", head)):
            r = measure(model, draft, args.k, ps, args.max_new_tokens, bs, stop=stop, prefix_cache=args.group > 1,
                        temperature=args.temperature)
            rows.append(("-", bs, name, r))
            print(bs, name, {k: round(x, 3) for k, x in r.items()})
    what = (args.model or f"preset {args.preset}") + (f" with the weights of {args.weights}" if args.weights else "")
    group = f", {args.prompts} held-out prompts x {args.group} samples with prefix caches" if args.group > 1 else ""
    group += f", temperature {args.temperature:g}" if args.temperature != 1.0 else ""
    return table(rows, f"### Speculative rollouts, {what} ({datetime.date.today()}): k={args.k}, "
                       f"max_new_tokens={args.max_new_tokens}{group}, {what_draft}")


def run_cost(args) -> str:
    """What one speculative step costs at a shape, in plain decode steps: the verify pass over k + 1 rows per
    request, and one draft step with the whole vocabulary and with --vocab-size rows of the head. From those,
    the tokens per pass (and the acceptance at k) that break even and that reach 2x."""
    from nemo_rz import ops

    model, _, what = shapes.load(args)
    cfg = model.config
    torch.manual_seed(0)
    drafts = {"whole vocabulary": DraftHead(cfg), f"vocabulary {args.vocab_size}": DraftHead(cfg, vocab_size=args.vocab_size)}
    cache, dcache = model.new_cache(max(args.batch_sizes), 256), drafts["whole vocabulary"].new_cache(max(args.batch_sizes), 256)

    def median(fn, n=9):
        fn()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return sorted(times)[n // 2]

    @torch.no_grad()
    def target(rows, seqs):  # a decode or verify step: `rows` query tokens per request, logprobs of all of them
        ids = torch.randint(0, cfg.vocab_size, (rows * seqs,))
        pos = torch.arange(100, 100 + rows).repeat(seqs)
        seq = torch.arange(seqs).repeat_interleave(rows)
        return ops.log_softmax(model.logits(model.step(ids, pos, seq, cache)), 1.0)

    @torch.no_grad()
    def draft_step(draft, seqs):  # one proposal per request: a draft layer, its logits, their softmax
        ids, pos, seq = torch.randint(0, cfg.vocab_size, (seqs,)), torch.full((seqs,), 100), torch.arange(seqs)
        g = draft.step(model, torch.randn(seqs, cfg.hidden_size), ids, pos, seq, dcache)
        return torch.softmax(draft.logits(model, g).float(), -1)

    out = [f"### Speculative step cost, {what} ({datetime.date.today()}): k={args.k}, in plain decode steps", "",
           "| batch | decode step ms | verify pass (k+1 rows) | draft step, whole vocab | draft step, reduced | "
           "spec step (reduced) = break-even tokens/pass | 2x tokens/pass | acceptance for 2x |",
           "|---|---|---|---|---|---|---|---|"]
    for bs in args.batch_sizes:
        base = median(lambda: target(1, bs))
        verify = median(lambda: target(args.k + 1, bs)) / base
        full, reduced = (median(lambda d=d: draft_step(d, bs)) / base for d in drafts.values())
        step = verify + args.k * reduced
        # tokens per pass at per-token acceptance a: 1 + a + ... + a^k; the a that reaches 2x, by bisection
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if sum(mid ** i for i in range(args.k + 1)) < 2 * step else (lo, mid)
        accept = f"{hi:.2f}" if 2 * step <= args.k + 1 else "unreachable"
        out.append(f"| {bs} | {base * 1e3:.1f} | {verify:.2f} | {full:.3f} | {reduced:.3f} | {step:.2f} | {2 * step:.2f} | "
                   f"{accept} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("task")
    t.add_argument("--updates", type=int, default=200)
    t.add_argument("--every", type=int, default=50)
    t.add_argument("--draft-updates", type=int, default=100)
    t.add_argument("--prompts", type=int, default=64)
    t.add_argument("--config", help="a preset (conf/NAME.yaml, e.g. deepseek_tiny) in place of the default job")
    t.add_argument("--draft-kind", choices=("eagle", "mtp"), default="eagle",
                   help="draft.kind: an EAGLE-3 head, or the model's multi-token-prediction layers (fresh for a fresh model)")
    t.add_argument("--override", nargs="*", default=[], help="more key=value config overrides")
    m = sub.add_parser("model")
    shapes.add_arguments(m)
    m.add_argument("--draft-updates", type=int, default=60)
    m.add_argument("--prompts", type=int, default=32, help="held-out prompts for the measurement")
    m.add_argument("--group", type=int, default=1, help="samples per held-out prompt, as in an RL batch; > 1 also "
                                                        "keeps the engines' prefix caches (the group shares its prefill)")
    m.add_argument("--train-prompts", type=int, default=96, help="prompts whose samples train the draft")
    m.add_argument("--max-new-tokens", type=int, default=64)
    m.add_argument("--lr", type=float, default=3e-3)
    m.add_argument("--steps", type=int, default=3, help="training-time-test steps")
    m.add_argument("--draft-layers", type=int, default=1, help="the draft's decoder layers")
    m.add_argument("--vocab-size", type=int, default=8192, help="draft vocabulary")
    m.add_argument("--save-draft", help="save the trained draft here (nemo_rz.models.draft.save_draft)")
    m.add_argument("--load-draft", help="measure a saved draft instead of training one")
    m.add_argument("--temperature", type=float, default=1.0, help="of the measured rollouts (0: greedy, e.g. evaluation)")
    m.add_argument("--weights", help="a checkpoint directory (runs/<run>/checkpoints/step_N) whose weights replace --model's, "
                                     "e.g. the policy of an RL run")
    c = sub.add_parser("cost")
    shapes.add_arguments(c, default="smollm2-135m")
    c.add_argument("--vocab-size", type=int, default=8192, help="the reduced draft vocabulary")
    for p in (t, m, c):
        p.add_argument("--k", type=int, default=4)
        p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print({"task": run_task, "model": run_model, "cost": run_cost}[args.what](args))


if __name__ == "__main__":
    main()
