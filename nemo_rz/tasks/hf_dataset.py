"""Hugging Face datasets as a task: local parquet / JSON / JSONL / CSV / arrow files or a `save_to_disk` directory,
read through the `datasets` package (imported here only: pip install -e ".[data]").

    task.name=hf_dataset task.options={path: gsm8k/train.parquet, prompt_field: question, answer_field: answer,
                                        answer_extractor: gsm8k, verifier: numeric, eval_path: gsm8k/test.parquet}

A row's prompt is `prompt_field` (text) or `messages_field` (a list of {"role", "content"}); its answer is
`answer_field` passed through `answer_extractor`: `gsm8k` takes what follows the last "####" (GSM8K's "... #### 42",
thousands separators dropped), `boxed` the last \\boxed{...} (MATH's solutions; nested braces kept), `none` the field
as it is. `verifier` is a registered verifier's name (exact, numeric, digits, boxed, math, or a plugin's). Held out:
the rows of `eval_split` (a split of the same dataset directory or files), of `eval_path`, or a seeded
`heldout_fraction` of the distinct prompts; no held-out prompt is trained on. Every bad row is one line naming the
file, the row and the field. `limit` keeps the first N training rows.
"""
from __future__ import annotations

import re
from pathlib import Path

from nemo_rz.tasks.base import Problem, Task
from nemo_rz.tasks.jsonl import _messages, _short, _split, _without_heldout, finished_task
from nemo_rz.tasks.options import Range, checked_by, limits
from nemo_rz.tasks.tokenizer import Tokenizer
from nemo_rz.tasks.verifiers import VERIFIERS

FORMATS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
EXTRACTORS = ("gsm8k", "boxed", "none")
_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.S)


def extract_gsm8k(text: str) -> str | None:
    """What follows GSM8K's last "####", without thousands separators ("#### 1,234" -> "1234"); None if absent."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.replace(",", "") if tail else None


def extract_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces matched); None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                inner = text[i + 1:j].strip()
                return inner or None
    return None


def _extract(kind: str, value, where: str, field: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field {field!r} must be a string or a number, got {_short(value)!r}")
    text = value if isinstance(value, str) else str(value)
    if kind == "none":
        if not text.strip():
            raise ValueError(f"{where}: field {field!r} is empty")
        return text.strip()
    found = extract_gsm8k(text) if kind == "gsm8k" else extract_boxed(text)
    if found is None:
        mark = '"#### <answer>"' if kind == "gsm8k" else "\\boxed{<answer>}"
        raise ValueError(f"{where}: field {field!r} has no {mark} ({_short(text)!r}); fix the row or set "
                         "task.options.answer_extractor (gsm8k, boxed, none)")
    return found


def _load(path: str, split: str, what: str):
    """The split `split` of the dataset at `path` (a file, or a save_to_disk directory), as a datasets.Dataset."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f'task hf_dataset needs the datasets package: pip install -e ".[data]" ({what} = {path})') from None
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{what} {p}: no such file or directory; give a parquet / json / jsonl / csv / arrow file or "
                         "a save_to_disk directory")
    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            loaded = datasets.load_from_disk(str(p))
        else:
            fmt = FORMATS.get(p.suffix.lower())
            if fmt is None:
                raise ValueError(f"{what} {p}: unknown format {p.suffix!r}; use one of {', '.join(FORMATS)} or a "
                                 "save_to_disk directory")
            loaded = datasets.load_dataset(fmt, data_files={split: str(p)}, split=None)
    except ValueError as e:
        if str(e).startswith(what):
            raise
        raise ValueError(f"{what} {p}: cannot read it ({' '.join(str(e).split())[:200]})") from None
    except Exception as e:  # datasets / pyarrow raise many kinds for a corrupt or foreign file
        raise ValueError(f"{what} {p}: cannot read it ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{what} {p} has no split {split!r}; it has {', '.join(loaded)}")
        return loaded[split]
    return loaded


def load_rows(path: str, split: str, prompt_field: str | None, messages_field: str | None, answer_field: str,
              answer_extractor: str, what: str = "task.options.path", limit: int | None = None) -> list[Problem]:
    """Problems from one split of a dataset; a bad row raises naming the file, the row and the field."""
    data = _load(path, split, what)
    field = prompt_field if messages_field is None else messages_field
    keys = {field: "messages_field" if messages_field is not None else "prompt_field", answer_field: "answer_field"}
    for name, key in keys.items():
        if name not in data.column_names:
            raise ValueError(f"{path} ({split}): no field {name!r}; it has {', '.join(data.column_names[:10])}; set "
                             f"task.options.{key}")
    problems = []
    rows = data.select_columns([field, answer_field])
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        where = f"{path} ({split}) row {i}"
        if messages_field is None:
            prompt = row[field]
            if not isinstance(prompt, str) or not prompt.strip():
                raise ValueError(f"{where}: field {field!r} must be non-empty text, got {_short(prompt)!r}")
        else:
            prompt = _messages(row[field], f"{where} field {field!r}")
        problems.append(Problem(prompt, _extract(answer_extractor, row[answer_field], where, answer_field), where))
    if not problems:
        raise ValueError(f"{path} ({split}): no rows; give a dataset with examples")
    return problems


def _check_options(options: dict) -> None:
    """Before any work: the fields and the extractor are named consistently, the paths exist, a fraction in (0, 1)."""
    if options.get("path") is None:
        raise ValueError("task hf_dataset needs task.options.path (a parquet / json / jsonl / csv / arrow file or a "
                         "save_to_disk directory)")
    if (options.get("prompt_field") is None) == (options.get("messages_field") is None):
        raise ValueError("task hf_dataset: set exactly one of task.options.prompt_field (text prompts) or "
                         "task.options.messages_field (chat messages)")
    extractor = options.get("answer_extractor", "none")
    if extractor not in EXTRACTORS:
        raise ValueError(f"task.options.answer_extractor = {extractor!r}: use one of {', '.join(EXTRACTORS)}")
    for key in ("path", "eval_path"):
        value = options.get(key)
        if value is not None and not Path(str(value)).exists():
            raise ValueError(f"task.options.{key} {value}: no such file or directory")
    if options.get("eval_split") is not None and options.get("eval_path") is not None:
        raise ValueError("task hf_dataset: set task.options.eval_split or task.options.eval_path, not both")
    fraction = options.get("heldout_fraction", 0.1)
    if not 0 < fraction < 1:
        raise ValueError(f"task.options.heldout_fraction must be in (0, 1), got {fraction}")


@limits(seed=Range(0), limit=Range(1))
@checked_by(_check_options)
def hf_dataset_task(path: str | None = None, split: str = "train", prompt_field: str | None = None,
                    messages_field: str | None = None, answer_field: str = "answer", answer_extractor: str = "none",
                    verifier: str = "exact", eval_split: str | None = None, eval_path: str | None = None,
                    heldout_fraction: float = 0.1, seed: int = 0, limit: int | None = None, name: str | None = None,
                    require_eos: bool = True, tokenizer: Tokenizer | None = None, chat_template="auto",
                    system_prompt: str | None = None) -> Task:
    """A Task from a Hugging Face dataset (see the module docstring)."""
    from nemo_rz import plugins

    if verifier not in VERIFIERS:
        raise ValueError(plugins.unknown("verifier", verifier) + f" (task.options.verifier for {path})")
    fields = dict(prompt_field=prompt_field, messages_field=messages_field, answer_field=answer_field,
                  answer_extractor=answer_extractor)
    problems = load_rows(path, split, **fields, limit=limit)
    if eval_split is not None or eval_path is not None:
        where = "task.options.eval_path" if eval_path is not None else "task.options.eval_split"
        heldout = load_rows(eval_path or path, eval_split or split, **fields, what=where)
        train = _without_heldout(problems, heldout, path, eval_path or f"{path} ({eval_split})")
    else:
        train, heldout = _split(problems, path, seed, heldout_fraction)
    return finished_task(name or f"hf_dataset:{path}", train, heldout, verifier, tokenizer, chat_template, require_eos,
                         system_prompt, answer_field)
