"""Find the first op whose rollout and learner outputs differ bitwise.

    python -m nemo_rz.tools.bisect [--model HF_DIR] [--kernels consistent|fast] [--force-fast OP ...]

Runs the engine's decode path (prefill the prompt, then one token per step against the KV cache) and the
learner's training forward (the whole batch at once) on the same tokens, with a hook on every call of every
op in nemo_rz.ops. For each decoded position it compares the op outputs row for row, in call order, and names
the first (position, module, op, shape) that differs. --force-fast runs chosen ops with library kernels on
purpose, to see the tool find them.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from nemo_rz import ops
from nemo_rz.errors import ArgumentParser
from nemo_rz.tools.common import (
    SEED_MAX,
    check_range,
    fail,
    forward_bytes_per_token,
    human_bytes,
    kv_bytes_per_token,
    load_model,
    random_prompts,
    traced_bytes_per_token,
    usable_memory,
)

TRACED = ("embedding", "linear", "rms_norm", "rope", "silu_and_mul", "attention", "log_softmax", "token_logprobs")


@dataclasses.dataclass
class Divergence:
    position: int
    call: int
    module: str
    op: str
    shape: tuple
    elements_differ: int
    max_abs_diff: float

    def __str__(self) -> str:
        return (f"first difference at position {self.position}, op call #{self.call}: {self.op} in {self.module or '<model>'} "
                f"output row shape {list(self.shape)}: {self.elements_differ} elements differ, max |diff| {self.max_abs_diff:.3e}")


@contextlib.contextmanager
def traced(model, records: list, force_fast=()):
    """Record (module, op, output) for every op call; run ops named in force_fast in fast mode."""
    stack = [""]

    def enter(name):
        return lambda module, args: stack.append(name) and None

    def leave(module, args, output):
        stack.pop()  # returns None: a forward hook that returns a value would replace the output

    hooks = []
    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(enter(name)))
        hooks.append(module.register_forward_hook(leave))
    originals = {name: getattr(ops, name) for name in TRACED}

    def wrap(name, fn):
        def call(*args, **kwargs):
            with ops.use_kernels("fast") if name in force_fast else contextlib.nullcontext():
                out = fn(*args, **kwargs)
            records.append((stack[-1], name, out.detach()))
            return out
        return call

    for name, fn in originals.items():
        setattr(ops, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(ops, name, fn)
        for h in hooks:
            h.remove()


@torch.no_grad()
def bisect(model, sequence: list[int], prompt_len: int, batch: list[list[int]], force_fast=()) -> tuple[Divergence | None, int]:
    """Compare decode-path and learner-forward op outputs for the tokens of `sequence` after its prompt.

    `batch` holds other sequences the learner scores alongside (a real training batch is never alone).
    Prompt positions are compared too: a difference there reaches later tokens through the KV cache.
    Returns (first divergence or None, number of op outputs compared).
    """
    length = max(len(s) for s in batch + [sequence])
    ids = torch.zeros(len(batch) + 1, length, dtype=torch.long)
    for i, s in enumerate([sequence] + batch):
        ids[i, : len(s)] = torch.tensor(s)
    learner: list = []
    with traced(model, learner, force_fast):
        model.hidden(model.tokens(ids))
    cache = model.new_cache(1, len(sequence) + 1)
    # The prompt is prefilled in one step, then each later token is decoded alone, as the engine does.
    steps = [(0, prompt_len)] + [(p, p + 1) for p in range(prompt_len, len(sequence))]
    compared = 0
    for start, end in steps:
        rollout: list = []
        with traced(model, rollout, force_fast):
            model.step(torch.tensor(sequence[start:end]), torch.arange(start, end), torch.zeros(end - start, dtype=torch.long), cache)
        for call, ((module, op, out), (_, _, full)) in enumerate(zip(rollout, learner)):
            ref = full[start:end]  # learner rows are [batch * time] with sequence 0 first
            compared += 1
            if not torch.equal(out, ref):
                rows = (out != ref).reshape(end - start, -1).any(-1)
                first = int(rows.nonzero()[0])
                d = (out[first].float() - ref[first].float()).abs()
                return Divergence(start + first, call, module, op, tuple(out.shape[1:]), int((out[first] != ref[first]).sum()),
                                  float(d.max())), compared
    return None, compared


def check_sizes(model, prompt_len: int, new_tokens: int, batch: int) -> None:
    """fail() unless the sequence fits the model's positions and the traced learner batch the machine's
    memory, before anything is allocated."""
    cfg = model.config
    positions = cfg.max_position_embeddings
    check_range("--prompt-len", prompt_len, 1, positions - 1, f"the prompt plus at least one new token must fit the "
                f"model's {positions} positions")
    check_range("--new-tokens", new_tokens, 1, positions - prompt_len, f"--prompt-len {prompt_len} plus the new "
                f"tokens must fit the model's {positions} positions")
    length = min(prompt_len + new_tokens + 4, positions)  # the learner batch's longest sequence
    per_seq = length * (traced_bytes_per_token(cfg) + forward_bytes_per_token(cfg, length)) \
        + (length + ops.KV_BLOCK) * kv_bytes_per_token(cfg)
    avail = usable_memory()
    most = avail // per_seq - 1  # the decoded sequence is in the learner's batch too
    memory = (f"the learner traces every op output of {batch + 1} sequences of up to {length} tokens, "
              f"~{human_bytes(per_seq)} each, and {human_bytes(avail)} is usable (80% of the available memory)")
    if most < 0:
        fail(f"--prompt-len {prompt_len} --new-tokens {new_tokens}: not even one sequence fits ({memory}); "
             "choose a shorter prompt or fewer new tokens")
    check_range("--batch", batch, 0, most, memory if batch > most else "")


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m nemo_rz.tools.bisect", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="Hugging Face checkpoint directory or .gguf file (default: a tiny random model)")
    ap.add_argument("--kernels", choices=ops.KERNELS, default=ops.get_kernels())
    ap.add_argument("--force-fast", nargs="*", default=[], metavar="OP", help=f"ops to run in fast mode: {', '.join(TRACED)}")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=7, help="other sequences in the learner's batch")
    ap.add_argument("--seed", type=int, default=0)
    try:
        args = ap.parse_args(argv)
    except ValueError as e:
        fail(str(e))
    unknown = sorted(set(args.force_fast) - set(TRACED))
    if unknown:
        fail(f"--force-fast {unknown[0]!r} is not an op; choose from {', '.join(TRACED)}")
    # the bounds that do not need the model, before loading it
    if args.prompt_len < 1:
        fail(f"--prompt-len {args.prompt_len}: must be >= 1 (and fit the model's positions)")
    if args.new_tokens < 1:
        fail(f"--new-tokens {args.new_tokens}: must be >= 1 (and fit the model's positions): with none, nothing is compared")
    if args.batch < 0:
        fail(f"--batch {args.batch}: must be >= 0 (and fit the memory)")
    check_range("--seed", args.seed, 0, SEED_MAX - 1)
    try:
        model = load_model(args.model, args.seed)
    except ValueError as e:
        fail(str(e))
    check_sizes(model, args.prompt_len, args.new_tokens, args.batch)
    vocab, total = model.config.vocab_size, args.prompt_len + args.new_tokens
    sequence = random_prompts(1, vocab, total, total, args.seed)[0]
    batch = random_prompts(args.batch, vocab, 2, min(total + 4, model.config.max_position_embeddings), args.seed + 1)
    try:
        with ops.use_kernels(args.kernels):
            found, compared = bisect(model, sequence, args.prompt_len, batch, args.force_fast)
    except ValueError as e:
        fail(str(e))
    forced = f", forced fast: {', '.join(args.force_fast)}" if args.force_fast else ""
    print(f"kernels={args.kernels}{forced}: compared {compared} op outputs over {args.new_tokens} decoded positions")
    print(found if found else "no op differs: decode path and learner forward agree bit for bit")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
