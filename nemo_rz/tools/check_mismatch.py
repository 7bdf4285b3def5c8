"""Compare the rollout engine's recorded logprobs with the learner's, token by token.

    python -m nemo_rz.tools.check_mismatch [--model HF_DIR] [--batch-sizes 1 8 32] [--kernels consistent|fast]

For each batch size, the engine generates that many completions together; the learner then scores all of
them in one padded batch. Prints a table and writes JSON (--out).
"""
from __future__ import annotations

import json
import math

import torch

from nemo_rz import atomic, ops
from nemo_rz.errors import ArgumentParser
from nemo_rz.generation import RolloutEngine, SamplingParams
from nemo_rz.generation.packing import pack
from nemo_rz.metrics import mismatch_metrics
from nemo_rz.tools.common import (
    SEED_MAX,
    check_range,
    fail,
    forward_bytes_per_token,
    human_bytes,
    kv_bytes_per_token,
    load_model,
    random_prompts,
    regular_file_problem,
    usable_memory,
)


def check(model, batch_sizes, max_new_tokens=32, prompt_len=(4, 24), temperature=1.0, seed=0) -> list[dict]:
    rows = []
    for bs in batch_sizes:
        prompts = random_prompts(bs, model.config.vocab_size, *prompt_len, seed=seed + bs)
        engine = RolloutEngine(model, max_batch_size=bs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed))
        batch = pack(outs)
        with torch.no_grad():
            learner = model.token_logprobs(batch.input_ids, batch.lengths, temperature or 1.0)
        m = mismatch_metrics(learner, batch.rollout_logprobs, batch.mask)
        rows.append(dict(batch_size=bs, tokens=m["n_tokens"], diff_tokens=m["diff_tokens"], max_abs_diff=m["max_abs_diff"], k3=m["k3"]))
    return rows


PROMPT_LEN = (4, 24)  # the random prompts' lengths


def check_sizes(model, batch_sizes: list[int], max_new_tokens: int) -> None:
    """fail() unless the largest batch fits the machine's memory and the new tokens the model's positions,
    before anything is allocated."""
    cfg = model.config
    positions = RolloutEngine(model, max_batch_size=1).max_model_len  # the engine's limit (no cache is made yet)
    room = positions - PROMPT_LEN[1]
    if room < 1:
        fail(f"the model's {positions} positions cannot hold check_mismatch's prompts of up to {PROMPT_LEN[1]} tokens "
             "plus a new token; use a model with more max_position_embeddings")
    check_range("--max-new-tokens", max_new_tokens, 1, room,
                f"a prompt of up to {PROMPT_LEN[1]} tokens plus the new tokens must fit the engine's {positions} positions")
    cache_len = positions + (-positions) % ops.KV_BLOCK
    length = PROMPT_LEN[1] + max_new_tokens
    per_seq = cache_len * kv_bytes_per_token(cfg) + length * forward_bytes_per_token(cfg, length)
    avail = usable_memory()
    most = avail // per_seq
    memory = (f"a sequence of {length} tokens needs ~{human_bytes(per_seq)} of KV cache and activations, "
              f"{human_bytes(avail)} is usable (80% of the available memory)")
    if most < 1:
        fail(f"--max-new-tokens {max_new_tokens}: not even one sequence fits ({memory}); lower --max-new-tokens")
    largest = max(batch_sizes)
    if largest > most:
        fail(f"--batch-sizes {largest}: every batch size must be in 1..{most} on this machine ({memory}); "
             "choose smaller batch sizes")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m nemo_rz.tools.check_mismatch", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="Hugging Face checkpoint directory or .gguf file (default: a tiny random model)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--kernels", choices=ops.KERNELS, default=ops.get_kernels())
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="check_mismatch.json", help="where to write the JSON report (a regular file)")
    try:
        args = ap.parse_args(argv)
    except ValueError as e:
        fail(str(e))
    if any(b < 1 for b in args.batch_sizes):
        fail(f"--batch-sizes {' '.join(map(str, args.batch_sizes))}: every batch size must be >= 1 (and fit the memory)")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        fail(f"--temperature {args.temperature}: must be a finite number >= 0 (0 = greedy)")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens {args.max_new_tokens}: must be >= 1 (and fit the model's positions)")
    check_range("--seed", args.seed, 0, SEED_MAX)
    problem = regular_file_problem(args.out)
    if problem:  # checked before the work, which an unwritable --out would waste
        fail(f"--out {args.out}: cannot write there ({problem}); choose a writable path of a regular file")
    try:
        model = load_model(args.model, args.seed)
    except ValueError as e:
        fail(str(e))
    check_sizes(model, args.batch_sizes, args.max_new_tokens)
    try:
        with ops.use_kernels(args.kernels):
            rows = check(model, args.batch_sizes, args.max_new_tokens, PROMPT_LEN, temperature=args.temperature, seed=args.seed)
    except ValueError as e:
        fail(str(e))
    print(f"kernels={args.kernels}  model={args.model or 'tiny random'}")
    print(f"{'batch':>6} {'tokens':>8} {'differ':>8} {'max|diff|':>11} {'k3':>11}")
    for r in rows:
        print(f"{r['batch_size']:>6} {r['tokens']:>8} {r['diff_tokens']:>8} {r['max_abs_diff']:>11.3e} {r['k3']:>11.3e}")
    problem = regular_file_problem(args.out)  # again: the path may have changed during the run
    if problem:
        fail(f"--out {args.out}: cannot write there ({problem}); nothing was written, choose a writable path of a regular file")
    try:
        atomic.write_text(args.out, json.dumps(dict(kernels=args.kernels, model=args.model, rows=rows), indent=2))
    except OSError as e:
        fail(f"--out {args.out}: cannot write it ({e.strerror})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
