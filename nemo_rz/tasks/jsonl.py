"""Bring-your-own data: one JSON object per line, {"prompt": text} or {"messages": [{"role", "content"}, ...]},
plus "answer" (a string or a number). Verifiers: verifiers.py (exact, numeric, digits, boxed, math).

Every problem with the data is found before training and reported in one line naming the file and line: a
missing file, a directory, bytes that are not UTF-8, invalid JSON, a missing or mistyped key, an answer the
verifier cannot check, messages that are not role/content pairs, text the tokenizer cannot encode (checked when
the task is built), and prompts too long for the model (Task.validate, once the model is known). Only regular
files are read (not /dev/zero, a FIFO...), of at most MAX_FILE_BYTES, lines of at most MAX_LINE_BYTES; a UTF-8
byte order mark at the start is skipped. Rows repeating a prompt are warned about once (stderr) and kept on one
side of the split: a held-out prompt is never trained on (with heldout_path too).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from nemo_rz.tasks.base import Problem, Task, use_chat
from nemo_rz.tasks.options import Range, checked_by, limits
from nemo_rz.tasks.tokenizer import DEFAULT_CHARS, CharTokenizer, Tokenizer
from nemo_rz.tasks.verifiers import VERIFIERS, check_answer

ROLES = ("system", "user", "assistant")
MAX_FILE_BYTES = 1 << 30  # a JSONL file: 1 GiB (its problems are held in memory, several times its size)
MAX_LINE_BYTES = 16 << 20  # one row: 16 MiB
MAX_NUMBER_DIGITS = 4000  # Python reads integers of up to 4300 digits; a longer answer must be a string
BOM = "\ufeff"


def _messages(value, where: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\": ..., \"content\": ...}} objects, "
                         f"got {_short(value)}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            raise ValueError(f"{where}: messages[{i}] must be an object with exactly 'role' and 'content', got "
                             f"{_short(m)}")
        if m["role"] not in ROLES or not isinstance(m["content"], str) or not m["content"]:
            raise ValueError(f"{where}: messages[{i}] needs a role in {', '.join(ROLES)} and non-empty text content, "
                             f"got role {_short(m['role'], 20)!r}, content {_short(m['content'], 40)!r}")
        out.append((m["role"], m["content"]))
    if out[-1][0] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; the prompt must end with a user turn")
    return tuple(out)


def _lines(path: Path, what: str):
    """(line number, text) of each non-blank line of a regular file; bytes that are not UTF-8 are refused naming
    the line; a UTF-8 byte order mark at the start is dropped."""
    from nemo_rz.config import open_regular

    with open_regular(path, what, MAX_FILE_BYTES, "give the path of a JSONL file") as f:
        lineno = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(f"{path}:{lineno}: a line of more than {MAX_LINE_BYTES} bytes; one row must be "
                                 "smaller (shorten the prompt, or check that the file is JSONL)")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if lineno == 1 and line.startswith(BOM):
                line = line[len(BOM):]
            if line.strip():
                yield lineno, line


def _int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_NUMBER_DIGITS:
        raise _LongNumber(digits)
    return int(text)


class _LongNumber(ValueError):
    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def _short(value, n: int = 60) -> str:
    """str(value)[:n], also for values nested too deeply to print."""
    try:
        return str(value)[:n]
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply to show"


def _parse(line: str, where: str):
    try:
        return json.loads(line, parse_int=_int)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg}); write one JSON object per line") from None
    except _LongNumber as e:
        raise ValueError(f"{where}: a number of {e.digits} digits, more than the {MAX_NUMBER_DIGITS} that are read as "
                         'a number; write it as a string ("123...")') from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to read (arrays or objects inside each other hundreds of levels "
                         'deep); write {"prompt": ..., "answer": ...}') from None
    except ValueError as e:  # anything else the decoder refuses
        raise ValueError(f"{where}: not valid JSON ({_short(e, 120)}); write one JSON object per line") from None


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
    for lineno, line in _lines(path, what):
        where = f"{path}:{lineno}"
        row = _parse(line, where)
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
            raise ValueError(f"{where}: {answer_key!r} must be a string or a number, got {_short(answer)}")
        if prompt_key in row:
            prompt = row[prompt_key]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{where}: {prompt_key!r} must be a non-empty string, got {_short(prompt)!r}")
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


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _by_prompt(problems: list[Problem]) -> dict:
    """prompt -> the indices of the problems that ask it, in file order (dicts keep the first one's place)."""
    groups: dict = {}
    for i, p in enumerate(problems):
        groups.setdefault(p.prompt, []).append(i)
    return groups


def _split(problems: list[Problem], path, seed: int, heldout_fraction: float) -> tuple[list[Problem], list[Problem]]:
    """(train, heldout): a seeded heldout_fraction of the distinct prompts held out. Rows repeating a prompt go
    with it (warned once), so no held-out prompt is ever trained on; without repeats, the same split as ever."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"jsonl task {path}: task.options.heldout_fraction must be in (0, 1) (or give heldout_path), "
                         f"got {heldout_fraction}")
    groups = list(_by_prompt(problems).values())
    repeats = [g for g in groups if len(g) > 1]
    if repeats:
        first = repeats[0]
        _warn(f"{path}: {sum(len(g) - 1 for g in repeats)} row(s) repeat the prompt of an earlier row (first: "
              f"{problems[first[1]].where} repeats {problems[first[0]].where}); each prompt is held out or trained on, "
              "never both, and held out once")
    order = list(range(len(groups)))
    random.Random(seed).shuffle(order)
    k = max(1, int(round(heldout_fraction * len(groups))))  # at least one problem to evaluate on
    if k >= len(groups):
        distinct = f" ({len(groups)} distinct prompt(s))" if repeats else ""
        raise ValueError(f"{path}: {len(problems)} example(s){distinct} leave none to train on after holding out {k}; "
                         "add examples or give a separate heldout_path")
    heldout = [problems[groups[g][0]] for g in order[:k]]
    train = [problems[i] for g in order[k:] for i in groups[g]]
    return train, heldout


def _without_heldout(train: list[Problem], heldout: list[Problem], path, heldout_path) -> list[Problem]:
    """The training problems whose prompt is not a held-out one (warned once, when some are)."""
    held = {p.prompt: p for p in heldout}
    kept = [p for p in train if p.prompt not in held]
    if len(kept) < len(train):
        first = next(p for p in train if p.prompt in held)
        _warn(f"{path}: {len(train) - len(kept)} row(s) ask a prompt of the held-out file {heldout_path} (first: "
              f"{first.where} = {held[first.prompt].where}); dropped from training, so that held-out stays unseen")
    if not kept:
        raise ValueError(f"{path}: every row asks a prompt of the held-out file {heldout_path}, which leaves none to "
                         "train on; give held-out problems that are not in the training file")
    return kept


def _check_options(options: dict) -> None:
    """With the config, before any work: the data files are regular, readable files of a size that can be read
    (opened, not read), and a held-out fraction is in (0, 1)."""
    from nemo_rz.config import open_regular

    for key in ("path", "heldout_path"):
        value = options.get(key)
        if value is not None or key == "path":
            what = f"task.options.{key}"
            with open_regular(str(_open_path(value, what)), what, MAX_FILE_BYTES, "give the path of a JSONL file"):
                pass
    fraction = options.get("heldout_fraction", 0.1)
    if options.get("heldout_path") is None and not 0 < fraction < 1:
        raise ValueError(f"jsonl task {options.get('path')}: task.options.heldout_fraction must be in (0, 1) (or give "
                         f"heldout_path), got {fraction}")


@limits(seed=Range(0))
@checked_by(_check_options)
def jsonl_task(path: str | None = None, verifier: str = "exact", seed: int = 0, heldout_fraction: float = 0.1,
               heldout_path: str | None = None, name: str | None = None, require_eos: bool = True,
               tokenizer: Tokenizer | None = None, chat_template="auto", system_prompt: str | None = None) -> Task:
    """A Task from JSONL: held out = heldout_path's problems, or a seeded heldout_fraction of path's distinct prompts.
    No prompt is both held out and trained on (repeats are warned about once).

    Without a tokenizer, a character tokenizer covering the data is built (plain prompts only).
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"unknown verifier {verifier!r} for {path}: use one of {', '.join(VERIFIERS)}")
    problems = load_jsonl(path)
    if heldout_path is not None:
        heldout = load_jsonl(heldout_path, what="task.options.heldout_path")
        train = _without_heldout(problems, heldout, path, heldout_path)
    else:
        train, heldout = _split(problems, path, seed, heldout_fraction)
    return finished_task(name or f"jsonl:{path}", train, heldout, verifier, tokenizer, chat_template, require_eos,
                         system_prompt)


def finished_task(name, train, heldout, verifier, tokenizer, chat_template, require_eos, system_prompt,
                  answer_field: str = "") -> Task:
    """The Task of loaded problems: every answer checked against the verifier (one line naming the problem's
    place, and `answer_field` where the data names its fields), the character tokenizer of the text unless one is
    given, and its text checked against the tokenizer."""
    for p in train + heldout:
        try:
            check_answer(verifier, p.answer)
        except ValueError as e:
            raise ValueError(f"{p.where}: " + (f"field {answer_field!r}: " if answer_field else "") + str(e)) from None
    tokenizer = tokenizer or _char_tokenizer(train + heldout)
    chat = use_chat(tokenizer, chat_template)
    task = Task(name, train, heldout, tokenizer, VERIFIERS[verifier], require_eos, chat, system_prompt)
    task.validate()  # text the tokenizer cannot encode, messages without chat: refused before any model is loaded
    return task
