"""Learner step cost: `Decoder.token_logprobs` forward + backward on a [batch, length] batch, consistent vs fast
kernels, same weights and tokens, interleaved (order alternates every repetition), 1 torch thread.

Reports process CPU time per step (median) and speed consistent/fast (median of per-repetition paired ratios;
target >= 0.9). The first step of each mode is a warm-up (it also runs the start-up probes of ops/verified.py).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/learner_step.py --preset smollm2-135m --batch 16 --length 64

With --rl: one `Learner.rl_step` on the SmolLM2 recipe's batch (conf/smollm2_arith.yaml: 4 prompts x 8 samples,
chat-rendered "What is a + b?" prompts with --model's tokenizer, --new-tokens completion tokens each), packed as the
trainer packs it, in two variants, each in a fresh subprocess (peak RSS is the process's ru_maxrss), alternating:
  padded:   the whole padded batch through the layers and the LM head + log-softmax at every position, unchunked
            (the learner's forward before packing);
  unshared: valid tokens only, the head only where the loss reads, in chunks, but every sequence's prompt run
            for itself (the learner's forward before shared prefixes);
  packed:   the learner's own path (models.decoder.Packing: a group's shared prompt runs once).
Reports each variant's step time (wall and process CPU, median over reps of the step after a warm-up step) and
peak RSS after loading the model and after the steps.

    python benchmarks/learner_step.py --rl --model models/smollm2-135m-instruct --reps 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

from nemo_rz import ops  # noqa: E402

MODES = ("consistent", "fast")
VARIANTS = ("padded", "unshared", "packed")


class PaddedPolicy(torch.nn.Module):
    """The policy as the learner ran it before packing: token_logprobs of the whole padded [B, T] batch, the LM
    head and log-softmax at every position in one piece, 0 past each length."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def token_logprobs(self, input_ids, lengths, temperature=1.0, mask=None):
        m, (b, length) = self.model, input_ids.shape
        hid = m.hidden(m.tokens(input_ids)).view(b, length, -1)[:, :-1].reshape(b * (length - 1), -1)
        lp = ops.token_logprobs(m.logits(hid), input_ids[:, 1:].reshape(-1), temperature).view(b, length - 1)
        valid = torch.arange(length - 1)[None, :] < (lengths[:, None] - 1)
        if mask is not None:
            valid &= mask != 0
        return torch.where(valid, lp, torch.zeros((), dtype=lp.dtype))


class UnsharedPolicy(torch.nn.Module):
    """The learner's packed path with each sequence's tokens its own rows (no prefix shared between sequences)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        model.packing = self.packing  # the instance's Packing: every valid position its own row

    @staticmethod
    def packing(input_ids, lengths):
        from nemo_rz.models.decoder import Packing, packed_rows

        b, length = input_ids.shape
        rows = packed_rows(lengths, length)
        where = torch.full((b * length,), -1, dtype=torch.long).index_put((rows,), torch.arange(rows.numel()))
        return Packing(rows, where.view(b, length))

    def token_logprobs(self, *args, **kwargs):
        return self.model.token_logprobs(*args, **kwargs)


def recipe_batch(model, path: str | None, prompts: int, group: int, new_tokens: int, seed: int):
    """The recipe's update batch: `prompts` chat prompts (--model's tokenizer; else 46 random ids) x `group`
    samples of `new_tokens` random completion tokens, packed by generation.packing.pack."""
    from nemo_rz.generation.packing import pack
    from nemo_rz.generation.sampling import Completion

    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    if path:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(path)

        def prompt():
            text = f"What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? Answer with just the number."
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5: a mapping
    else:
        def prompt():
            return torch.randint(0, vocab, (46,), generator=g).tolist()
    out = []
    for _ in range(prompts):
        p = prompt()
        for _ in range(group):
            out.append(Completion(p, torch.randint(0, vocab, (new_tokens,), generator=g).tolist(),
                                  torch.full((new_tokens,), -2.0), 0, "length"))
    return pack(out)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def rl_child(args) -> None:
    """One variant in this process: a warm-up rl_step, then --steps timed ones; one JSON line."""
    from nemo_rz.runtime.learner import Learner

    torch.set_num_threads(1)
    model, _, desc = shapes.load(args, args.seed)
    loaded = peak_rss_gb()
    batch = recipe_batch(model, args.model, args.prompts, args.group, args.new_tokens, args.seed)
    policy = {"packed": model, "unshared": UnsharedPolicy(model), "padded": PaddedPolicy(model)}[args.variant]
    learner = Learner(policy, 1e-5, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    adv = torch.tensor([1.0, -1.0] * (batch.input_ids.shape[0] // 2) + [0.0] * (batch.input_ids.shape[0] % 2))
    wall, cpu = [], []
    for i in range(1 + args.steps):
        w0, c0 = time.perf_counter(), time.process_time()
        learner.rl_step(batch, adv)
        if i:
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    print(json.dumps(dict(variant=args.variant, desc=desc, shape=list(batch.input_ids.shape),
                          tokens=int(batch.lengths.sum()), loss_tokens=int(batch.mask.sum()),
                          wall=statistics.median(wall), cpu=statistics.median(cpu), rss_loaded=loaded, rss_peak=peak_rss_gb())))


def rl_main(args) -> None:
    child = [sys.executable, __file__, "--rl-variant-child", "--seed", str(args.seed), "--steps", str(args.steps),
             "--prompts", str(args.prompts), "--group", str(args.group), "--new-tokens", str(args.new_tokens)]
    child += ["--model", args.model] if args.model else ["--preset", args.preset] + (["--layers", str(args.layers)] if args.layers else [])
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads 1")
    runs = {v: [] for v in VARIANTS}
    for rep in range(args.reps):
        for variant in (VARIANTS if rep % 2 == 0 else VARIANTS[::-1]):
            out = subprocess.run(child + ["--variant", variant], check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[variant].append(r)
            print(f"rep {rep + 1} {variant}: step {r['wall']:.2f}s wall {r['cpu']:.2f}s cpu, peak RSS {r['rss_peak']:.2f} GB "
                  f"(after load {r['rss_loaded']:.2f} GB)", flush=True)
    r = runs["packed"][0]
    print(f"model {r['desc']}\nbatch {r['shape']}: {r['tokens']} valid tokens, {r['loss_tokens']} read by the loss")
    print("\n| variant | step s (wall) | step s (cpu) | peak RSS GB | RSS after load GB |\n|---|---|---|---|---|")
    for v in VARIANTS:
        med = {k: statistics.median(x[k] for x in runs[v]) for k in ("wall", "cpu", "rss_peak", "rss_loaded")}
        print(f"| {v} | {med['wall']:.2f} | {med['cpu']:.2f} | {med['rss_peak']:.2f} | {med['rss_loaded']:.2f} |")
    for base in ("padded", "unshared"):
        ratio = {k: statistics.median(a[k] / b[k] for a, b in zip(runs[base], runs["packed"])) for k in ("wall", "cpu", "rss_peak")}
        print(f"{base}/packed (median paired): step time {ratio['wall']:.2f}x wall, {ratio['cpu']:.2f}x cpu; "
              f"peak RSS {ratio['rss_peak']:.2f}x")


def step(model, ids: torch.Tensor, mode: str) -> tuple[float, float]:
    """(forward, backward) process CPU seconds of one learner step."""
    with ops.use_kernels(mode):
        model.zero_grad(set_to_none=True)
        c0 = time.process_time()
        lp = model.token_logprobs(ids)
        c1 = time.process_time()
        lp.sum().backward()
        return c1 - c0, time.process_time() - c1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shapes.add_arguments(ap)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rl", action="store_true", help="Learner.rl_step on the recipe's batch, padded vs packed (see above)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1, help="--rl: timed steps per subprocess, after one warm-up step")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--rl-variant-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rl_variant_child:
        return rl_child(args)
    if args.rl:
        return rl_main(args)
    torch.set_num_threads(1)
    model, _, desc = shapes.load(args, args.seed)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.length), generator=torch.Generator().manual_seed(args.seed))
    print(f"date {datetime.date.today()}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"model {desc}; batch [{args.batch}, {args.length}]")
    for mode in MODES:
        step(model, ids, mode)  # warm-up
    times = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            fwd, bwd = step(model, ids, mode)
            times[mode].append((fwd, bwd))
            print(f"rep {rep + 1} {mode}: forward {fwd:.2f}s backward {bwd:.2f}s", flush=True)
    print("\n| mode | forward s | backward s | step s |\n|---|---|---|---|")
    for mode in MODES:
        f = statistics.median(t[0] for t in times[mode])
        b = statistics.median(t[1] for t in times[mode])
        s = statistics.median(sum(t) for t in times[mode])
        print(f"| {mode} | {f:.2f} | {b:.2f} | {s:.2f} |")
    ratio = statistics.median(sum(f) / sum(c) for c, f in zip(times["consistent"], times["fast"]))
    print(f"\nspeed consistent/fast (median paired): {ratio:.2f}x  target >= 0.9: {'MET' if ratio >= 0.9 else 'MISSED'}")


if __name__ == "__main__":
    main()
