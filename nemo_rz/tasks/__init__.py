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
"""
from __future__ import annotations

import functools
import inspect

from nemo_rz import plugins
from nemo_rz.tasks import arithmetic
from nemo_rz.tasks.base import Problem, Task
from nemo_rz.tasks.hf_tokenizer import HFTokenizer
from nemo_rz.tasks.jsonl import jsonl_task, load_jsonl
from nemo_rz.tasks.rewards import evaluate_pass_at_1, safe_reward
from nemo_rz.tasks.tokenizer import CharTokenizer, Tokenizer

# The sized arithmetic tasks, as the entry points in setup.py name them (reverse and jsonl are registered directly).
add1, add2, add3 = (functools.partial(arithmetic.addition, d) for d in (1, 2, 3))
mul1, mul2 = (functools.partial(arithmetic.multiplication, d) for d in (1, 2))
TASKS = plugins.Registry("task")  # every registered task: the built-ins above, then plugins'
_RENDERING = ("tokenizer", "chat_template", "system_prompt")  # set by make_task's own arguments, not task options


def load_tokenizer(spec) -> Tokenizer | None:
    """None / "char": None (each task builds its character tokenizer); a path: HFTokenizer; an object: itself."""
    if spec is None or spec == "char":
        return None
    if isinstance(spec, str):
        return HFTokenizer.from_pretrained(spec)
    return spec


def make_task(name: str, tokenizer=None, chat_template="auto", system_prompt: str | None = None, **kw) -> Task:
    """The task registered as `name`, built with keyword arguments kw (see the module docstring)."""
    fn = plugins.load("task", name)
    params = [p for p in inspect.signature(fn).parameters if p not in _RENDERING]
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise ValueError(f"task {name!r}: unknown option(s) {', '.join(unknown)}: valid are {', '.join(params)}")
    return fn(tokenizer=load_tokenizer(tokenizer), chat_template=chat_template, system_prompt=system_prompt, **kw)


__all__ = ["TASKS", "CharTokenizer", "HFTokenizer", "Problem", "Task", "Tokenizer", "evaluate_pass_at_1", "jsonl_task",
           "load_jsonl", "load_tokenizer", "make_task", "safe_reward"]
