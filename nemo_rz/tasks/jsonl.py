"""Bring-your-own data: one JSON object per line, {"prompt": text} or {"messages": [{"role", "content"}, ...]},
plus "answer" (a string or a number). Verifiers: verifiers.py (exact, numeric, digits, boxed, math).

Every problem with the data is found before training and reported in one line naming the file and line: a
missing file, a directory, bytes that are not UTF-8, invalid JSON, a missing or mistyped key, an answer the
verifier cannot check, messages that are not role/content pairs, text the tokenizer cannot encode (checked when
the task is built), and prompts too long for the model (Task.validate, once the model is known).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from nemo_rz.tasks.base import Problem, Task, use_chat
from nemo_rz.tasks.tokenizer import DEFAULT_CHARS, CharTokenizer, Tokenizer
from nemo_rz.tasks.verifiers import VERIFIERS, check_answer

ROLES = ("system", "user", "assistant")


def _messages(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects, "
                         f"got {str(value)[:60]}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"{where}: messages[{i}] must be an object with exactly 'role' and 'content', got "
                             f"{str(m)[:60]}")
        if m["role"] not in ROLES or not isinstance(m["content"], str) or not m["content"]:
            raise ValueError(f"{where}: messages[{i}] needs a role in {', '.join(ROLES)} and non-empty text content, "
                             f"got role {str(m['role'])[:20]!r}, content {str(m['content'])[:40]!r}")
        out.append((m["role"], m["content"]))
    if out[-1][0] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; the prompt must end with a user turn")
    return tuple(out)


def _lines(path: Path):
    """(line number, text) of each non-blank line; bytes that are not UTF-8 are refused naming the line."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if line.strip():
                yield lineno, line


def _open_path(path, what: str) -> Path:
    if path is None:
        raise ValueError(f"the jsonl task needs {what}: set task.options.path=FILE.jsonl")
    p = Path(str(path))
    if not p.exists():
        raise ValueError(f"{what} {p}: no such file; give the path of a JSONL file")
    if p.is_dir():
        raise ValueError(f"{what} {p} is a directory; give the path of a JSONL file")
    return p


def load_jsonl(path, prompt_key: str = "prompt", answer_key: str = "answer", messages_key: str = "messages",
               what: str = "task.options.path") -> list[Problem]:
    """Problems from a JSONL file; blank lines are skipped; a bad line raises naming file and line."""
    path = _open_path(path, what)
    problems = []
    for lineno, line in _lines(path):
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg}); write one JSON object per line") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}; "
                             f'write {{"{prompt_key}": ..., "{answer_key}": ...}}')
        if (prompt_key in row) == (messages_key in row):
            has = ", ".join(repr(k)[:40] for k in list(row)[:5]) or "none"
            raise ValueError(f"{where}: needs exactly one of {prompt_key!r} (text) or {messages_key!r} (chat), has {has}")
        if answer_key not in row:
            raise ValueError(f"{where}: missing key {answer_key!r} (has {', '.join(repr(k)[:40] for k in list(row)[:5])}); "
                             "add it or set the key name")
        answer = row[answer_key]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got {str(answer)[:60]}")
        if prompt_key in row:
            prompt = row[prompt_key]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {str(prompt)[:60]!r}")
        else:
            prompt = _messages(row[messages_key], where)
        problems.append(Problem(prompt, answer if isinstance(answer, str) else json.dumps(answer), where))
    if not problems:
        raise ValueError(f"{path}: no examples found; add lines like "
                         f'{{"{prompt_key}": "2+2=", "{answer_key}": "4"}}')
    return problems


def _char_tokenizer(problems: list[Problem]) -> CharTokenizer:
    """The default alphabet plus every other character of the data, sorted: the same files give the same ids."""
    seen = {c for p in problems for c in (p.prompt if isinstance(p.prompt, str) else "") + p.answer}
    return CharTokenizer(DEFAULT_CHARS + "".join(sorted(seen - set(DEFAULT_CHARS))))


def jsonl_task(path: str | None = None, verifier: str = "exact", seed: int = 0, heldout_fraction: float = 0.1,
               heldout_path: str | None = None, name: str | None = None, require_eos: bool = True,
               tokenizer: Tokenizer | None = None, chat_template="auto", system_prompt: str | None = None) -> Task:
    """A Task from JSONL: held out = heldout_path's problems, or a seeded heldout_fraction of path's.

    Without a tokenizer, a character tokenizer covering the data is built (plain prompts only).
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r} for {path}: use one of {', '.join(VERIFIERS)}")
    problems = load_jsonl(path)
    if heldout_path is not None:
        train, heldout = problems, load_jsonl(heldout_path, what="task.options.heldout_path")
    else:
        if not 0 < heldout_fraction < 1:
            raise ValueError(f"jsonl task {path}: heldout_fraction must be in (0, 1) (or give heldout_path), "
                             f"got {heldout_fraction}")
        order = list(range(len(problems)))
        random.Random(seed).shuffle(order)
        k = max(1, int(round(heldout_fraction * len(problems))))  # at least one problem to evaluate on
        if k >= len(problems):
            raise ValueError(f"{path}: {len(problems)} example(s) leave none to train on after holding out {k}; "
                             "add examples or give a separate heldout_path")
        heldout, train = [problems[i] for i in order[:k]], [problems[i] for i in order[k:]]
    for p in train + heldout:
        try:
            check_answer(verifier, p.answer)
        except ValueError as e:
            raise ValueError(f"{p.where}: {e}") from None
    tokenizer = tokenizer or _char_tokenizer(train + heldout)
    chat = use_chat(tokenizer, chat_template)
    task = Task(name or f"jsonl:{path}", train, heldout, tokenizer, VERIFIERS[verifier], require_eos, chat, system_prompt)
    task.validate()  # text the tokenizer cannot encode, messages without chat: refused before any model is loaded
    return task
