"""Find the first op whose rollout and learner outputs differ bitwise.

    python -m nemo_rz.tools.bisect [--model HF_DIR] [--mode consistent|fast] [--force-fast OP ...]

Runs the engine's decode path (prefill the prompt, then one token per step against the KV cache) and the
learner's training forward (the whole batch at once) on the same tokens, with a hook on every call of every
op in nemo_rz.ops. For each decoded position it compares the op outputs row for row, in call order, and names
the first (position, module, op, shape) that differs. --force-fast runs chosen ops with library kernels on
purpose, to see the tool find them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses

import torch

from nemo_rz import ops
from nemo_rz.tools.common import fail, load_model, random_prompts

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
            with ops.mode("fast") if name in force_fast else contextlib.nullcontext():
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
        model.hidden(model._dense(ids))
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
                return Divergence(start + first, call, module, op, tuple(out.shape[1:]), int((out[first] != ref[first]).sum()), float(d.max())), compared
    return None, compared


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_rz.tools.bisect", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="Hugging Face checkpoint directory or .gguf file (default: a tiny random model)")
    ap.add_argument("--mode", choices=ops.MODES, default=ops.get_mode())
    ap.add_argument("--force-fast", nargs="*", default=[], metavar="OP", help=f"ops to run in fast mode: {', '.join(TRACED)}")
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch", type=int, default=7, help="other sequences in the learner's batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.force_fast) - set(TRACED))
    if unknown:
        fail(f"--force-fast {unknown[0]!r} is not an op; choose from {', '.join(TRACED)}")
    try:
        model = load_model(args.model, args.seed)
    except ValueError as e:
        fail(str(e))
    vocab, total = model.config.vocab_size, args.prompt_len + args.new_tokens
    sequence = random_prompts(1, vocab, total, total, args.seed)[0]
    batch = random_prompts(args.batch, vocab, 2, total + 4, args.seed + 1)
    with ops.mode(args.mode):
        found, compared = bisect(model, sequence, args.prompt_len, batch, args.force_fast)
    forced = f", forced fast: {', '.join(args.force_fast)}" if args.force_fast else ""
    print(f"mode={args.mode}{forced}: compared {compared} op outputs over {args.new_tokens} decoded positions")
    print(found if found else "no op differs: decode path and learner forward agree bit for bit")
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
