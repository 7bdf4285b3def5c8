"""Verifiable-reward tasks. make_task(name, **kw) builds one from the registry:

  add1, add2, add3   d-digit addition "12+34=" -> "46"               (kw: seed, n_train, n_heldout, tokenizer)
  mul1, mul2         d-digit by 1-digit multiplication "12*3=" -> "36"
  reverse            reverse a digit string "rev 120=" -> "021"     (kw also: min_len=3, max_len=5)
  jsonl              {"prompt", "answer"} lines                      (kw: path, verifier=exact|numeric,
                                                                      seed, heldout_fraction, heldout_path)
"""
from __future__ import annotations

import difflib
import functools
import inspect

from nemo_rz.tasks import arithmetic
from nemo_rz.tasks.base import Problem, Task
from nemo_rz.tasks.jsonl import jsonl_task, load_jsonl
from nemo_rz.tasks.rewards import evaluate_pass_at_1, safe_reward
from nemo_rz.tasks.tokenizer import CharTokenizer

TASKS = {
    "add1": functools.partial(arithmetic.addition, 1),
    "add2": functools.partial(arithmetic.addition, 2),
    "add3": functools.partial(arithmetic.addition, 3),
    "mul1": functools.partial(arithmetic.multiplication, 1),
    "mul2": functools.partial(arithmetic.multiplication, 2),
    "reverse": arithmetic.reverse,
    "jsonl": jsonl_task,
}


def make_task(name: str, **kw) -> Task:
    """The task registered as `name`, built with keyword arguments kw (see the module docstring)."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"unknown task {name!r}{hint}: use one of {', '.join(TASKS)}")
    fn = TASKS[name]
    params = inspect.signature(fn).parameters
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise ValueError(f"task {name!r}: unknown option(s) {', '.join(unknown)}: valid are {', '.join(params)}")
    return fn(**kw)


__all__ = ["TASKS", "CharTokenizer", "Problem", "Task", "evaluate_pass_at_1", "jsonl_task", "load_jsonl",
           "make_task", "safe_reward"]
