"""Bring-your-own data: one JSON object per line, {"prompt": ..., "answer": ...}.

Verifiers (text = completion decoded up to EOS):
  exact    1.0 iff text.strip() == answer.strip()
  numeric  1.0 iff both parse as numbers (commas dropped) and |x - y| <= max(rel_tol * max(|x|, |y|), abs_tol)
"""
from __future__ import annotations

import json
import math
import random

from nemo_rz.tasks.base import Problem, Task
from nemo_rz.tasks.tokenizer import DEFAULT_CHARS, CharTokenizer


def exact(text: str, answer: str) -> float:
    return 1.0 if text.strip() == answer.strip() else 0.0


def _number(s: str) -> float | None:
    try:
        x = float(s.strip().replace(",", ""))
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def numeric(text: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    x, y = _number(text), _number(answer)
    if y is None:
        raise ValueError(f"numeric verifier: answer {answer!r} is not a number; use the exact verifier")
    return 1.0 if x is not None and math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


VERIFIERS = {"exact": exact, "numeric": numeric}


def load_jsonl(path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Problem]:
    """Problems from a JSONL file; blank lines are skipped; a bad line raises naming file and line."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}); write one JSON object per line") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}; "
                                 f'write {{"{prompt_key}": ..., "{answer_key}": ...}}')
            for key in (prompt_key, answer_key):
                if key not in row:
                    raise ValueError(f"{where}: missing key {key!r} (has {', '.join(map(repr, row)) or 'none'}); "
                                     f"add it or set the key name")
            prompt, answer = row[prompt_key], row[answer_key]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {prompt!r}")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got {answer!r}")
            problems.append(Problem(prompt, answer if isinstance(answer, str) else json.dumps(answer)))
    if not problems:
        raise ValueError(f"{path}: no examples found; add lines like "
                         f'{{"{prompt_key}": "2+2=", "{answer_key}": "4"}}')
    return problems


def jsonl_task(path: str, verifier: str = "exact", seed: int = 0, heldout_fraction: float = 0.1,
               heldout_path: str | None = None, name: str | None = None, require_eos: bool = True) -> Task:
    """A Task from JSONL: held out = heldout_path's problems, or a seeded heldout_fraction of path's.

    The tokenizer is the default alphabet plus every other character in the data, in sorted order,
    so the same files always give the same ids.
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r} for {path}: use one of {', '.join(VERIFIERS)}")
    problems = load_jsonl(path)
    if heldout_path is not None:
        train, heldout = problems, load_jsonl(heldout_path)
    else:
        if not 0 <= heldout_fraction < 1:
            raise ValueError(f"jsonl task {path}: heldout_fraction must be in [0, 1), got {heldout_fraction}")
        order = list(range(len(problems)))
        random.Random(seed).shuffle(order)
        k = int(round(heldout_fraction * len(problems)))
        heldout, train = [problems[i] for i in order[:k]], [problems[i] for i in order[k:]]
    if verifier == "numeric":
        for p in train + heldout:
            if _number(p.answer) is None:
                raise ValueError(f"{path}: answer {p.answer!r} (prompt {p.prompt!r}) is not a number; "
                                 "use verifier=exact or fix the answer")
    seen = {c for p in problems + heldout for c in p.prompt + p.answer}
    chars = DEFAULT_CHARS + "".join(sorted(seen - set(DEFAULT_CHARS)))
    return Task(name or f"jsonl:{path}", train, heldout, CharTokenizer(chars), VERIFIERS[verifier], require_eos)
