"""Reward plumbing that never lets a broken verifier stop training.

safe_reward turns an exception (or a non-finite / non-numeric reward) into reward 0 plus an error string
that the caller counts and logs; evaluate_pass_at_1 takes the generator as a plain callable so it does
not depend on any engine.
"""
from __future__ import annotations

import math
from typing import Callable


def safe_reward(fn: Callable, completion, answer) -> tuple[float, str | None]:
    """(fn(completion, answer), None), or (0.0, "ExcType: message") when fn raises or returns a bad value."""
    try:
        r = fn(completion, answer)
    except Exception as e:  # a reward function's bug must cost one sample, not the run
        return 0.0, f"{type(e).__name__}: {e}"
    try:
        r = float(r)
    except (TypeError, ValueError):
        return 0.0, f"reward is not a number: {r!r}"
    if not math.isfinite(r):
        return 0.0, f"reward is not finite: {r}"
    return r, None


def evaluate_pass_at_1(generate_fn: Callable[[list[list[int]]], list[list[int]]], task, split: str = "heldout",
                       limit: int | None = None, batch_size: int = 256) -> dict:
    """pass@1 of one completion per problem of task.split(split) (first `limit` problems).

    generate_fn(prompts as token-id lists) -> completions as token-id lists (after the prompt), one each;
    greedy or sampled is the caller's choice. Returns {"pass_at_1", "n", "reward_errors", "first_error"}.
    """
    problems = task.split(split)[:limit]
    if not problems:
        raise ValueError(f"evaluate_pass_at_1: task {task.name} has no {split} problems to evaluate")
    total, errors, first_error = 0.0, 0, None
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        outs = generate_fn([task.encode_prompt(p.prompt) for p in chunk])
        if len(outs) != len(chunk):
            raise ValueError(f"evaluate_pass_at_1: generate_fn returned {len(outs)} completions for {len(chunk)} "
                             "prompts; it must return one per prompt, in order")
        for p, out in zip(chunk, outs):
            r, err = safe_reward(task.reward, out, p.answer)
            total += 1.0 if r >= 1.0 else 0.0
            if err is not None:
                errors += 1
                first_error = first_error or err
    return {"pass_at_1": total / len(problems), "n": len(problems), "reward_errors": errors,
            "first_error": first_error}
