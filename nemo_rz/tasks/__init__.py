"""Verifiable-reward tasks. make_task(name, tokenizer=..., chat_template=..., system_prompt=..., **kw) builds one:

  add1, add2, add3   d-digit addition "12+34=" -> "46"               (kw: seed, n_train, n_heldout)
  mul1, mul2         d-digit by 1-digit multiplication "12*3=" -> "36"
  reverse            reverse a digit string "rev 120=" -> "021"     (kw also: min_len=3, max_len=5)
  jsonl              {"prompt" | "messages", "answer"} lines         (kw: path, verifier=exact|numeric|digits|boxed|math,
                                                                      seed, heldout_fraction, heldout_path)
tokenizer: None or "char" (the character tokenizer), a checkpoint directory or .gguf file (its HFTokenizer),
or a tokenizer object. With a chat template (chat_template auto|true), prompts are rendered as chat messages;
the built-in tasks then ask word problems ("What is 12 + 34? ...") and read the last number of the reply.
Tasks are registered by name (nemo_rz.plugins, entry points task.<name>): another package adds one the same way.
Options are typed from the task function's signature and ranged by its @options.limits (tasks/options.py).
"""
from __future__ import annotations

import functools

from nemo_rz import plugins
from nemo_rz.tasks import arithmetic, options
from nemo_rz.tasks.base import Problem, Task
from nemo_rz.tasks.hf_tokenizer import HFTokenizer
from nemo_rz.tasks.jsonl import jsonl_task, load_jsonl
from nemo_rz.tasks.rewards import evaluate_pass_at_1, safe_reward
from nemo_rz.tasks.tokenizer import CharTokenizer, Tokenizer

# The sized arithmetic tasks, as the entry points in setup.py name them (reverse and jsonl are registered directly).
add1, add2, add3 = (functools.partial(arithmetic.addition, d) for d in (1, 2, 3))
mul1, mul2 = (functools.partial(arithmetic.multiplication, d) for d in (1, 2))
TASKS = plugins.Registry("task")  # every registered task: the built-ins above, then plugins'


def load_tokenizer(spec) -> Tokenizer | None:
    """None / "char": None (each task builds its character tokenizer); a path: HFTokenizer; an object: itself."""
    if spec is None or spec == "char":
        return None
    if isinstance(spec, str):
        return HFTokenizer.from_pretrained(spec)
    return spec


def make_task(name: str, tokenizer=None, chat_template="auto", system_prompt: str | None = None, **kw) -> Task:
    """The task registered as `name`, built with keyword arguments kw (see the module docstring), each checked
    against the task's declared options (tasks/options.py): one line for an unknown, mistyped or out-of-range one."""
    fn = plugins.load("task", name)
    kw = options.check(name, fn, kw)
    return fn(tokenizer=load_tokenizer(tokenizer), chat_template=chat_template, system_prompt=system_prompt, **kw)


__all__ = ["TASKS", "CharTokenizer", "HFTokenizer", "Problem", "Task", "Tokenizer", "evaluate_pass_at_1", "jsonl_task",
           "load_jsonl", "load_tokenizer", "make_task", "safe_reward"]
