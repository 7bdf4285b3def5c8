"""task.name=hf_dataset: Hugging Face datasets files (parquet here, GSM8K-shaped: question / "... #### 42") as a task.

The answer extractors (gsm8k's "####", boxed's \\boxed{} with nested braces), held-out splits (a fraction of the
distinct prompts, another split of a save_to_disk directory), and every bad-data case as one line naming the file,
the row and the field. A short in-process training run on the parquet file (tests/test_loggers.py shares it) trains
through the task and exports at the end (export.on_finish=true).
"""
from __future__ import annotations

import pytest

from nemo_rz.tasks import make_task
from nemo_rz.tasks.hf_dataset import extract_boxed, extract_gsm8k

datasets = pytest.importorskip("datasets")

ROWS = [dict(question=f"{a}+{b}=", answer=f"{a} plus {b} is {a + b}.\n#### {a + b}") for a in range(4) for b in range(5)]
GSM8K = dict(prompt_field="question", answer_field="answer", answer_extractor="gsm8k", verifier="numeric")


def gsm8k_parquet(path, rows=ROWS):
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


def test_extractors():
    assert extract_gsm8k("Natalia sold 48 + 24 = 72 clips.\n#### 1,234") == "1234"
    assert extract_gsm8k("#### 5 then #### 7") == "7" and extract_gsm8k("no marker") is None
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and finally \boxed{x^{2}}") == "x^{2}"
    assert extract_boxed(r"\boxed{unclosed") is None and extract_boxed("none") is None


def test_gsm8k_parquet_task_and_held_out_splits(tmp_path):
    path = gsm8k_parquet(tmp_path / "train.parquet")
    task = make_task("hf_dataset", path=str(path), **GSM8K, heldout_fraction=0.25, seed=1)
    assert len(task.train) + len(task.heldout) == len(ROWS) and len(task.heldout) == 5
    assert {p.prompt for p in task.train}.isdisjoint({p.prompt for p in task.heldout})
    first = next(p for p in task.train + task.heldout if p.prompt == "2+3=")
    assert first.answer == "5" and "row 13" in first.where
    assert task.reward(task.tokenizer.encode("5", eos=True), "5") == 1.0
    # a save_to_disk directory with its own test split: held out = that split
    folder = tmp_path / "saved"
    datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS[:15]), test=datasets.Dataset.from_list(ROWS[15:])).save_to_disk(str(folder))
    split = make_task("hf_dataset", path=str(folder), **GSM8K, eval_split="test")
    assert [p.prompt for p in split.heldout] == [r["question"] for r in ROWS[15:]] and len(split.train) == 15
    # chat messages and \boxed{} answers, no extraction of a number answer field
    rows = [dict(messages=[dict(role="user", content=f"{a}*2=")], solution=f"so \\boxed{{{2 * a}}}") for a in range(6)]
    gsm8k_parquet(tmp_path / "chat.parquet", rows)
    from tiny_hf import bpe_tokenizer

    from nemo_rz.tasks import HFTokenizer

    chat = make_task("hf_dataset", path=str(tmp_path / "chat.parquet"), messages_field="messages", answer_field="solution",
                     answer_extractor="boxed", verifier="exact", tokenizer=HFTokenizer(bpe_tokenizer()), heldout_fraction=0.5)
    assert sorted(p.answer for p in chat.train + chat.heldout) == ["0", "10", "2", "4", "6", "8"]


@pytest.mark.parametrize("change, fragment", [
    (dict(rows=[dict(question="1+1=", answer="two")]), "row 0: field 'answer' has no \"#### <answer>\""),
    (dict(rows=[dict(question="", answer="#### 2")] * 2), "row 0: field 'question' must be non-empty text"),
    (dict(rows=[dict(question="1+1=", answer="#### two"), dict(question="2+2=", answer="#### 4")]), "row 0: field 'answer':"),
    (dict(options=dict(prompt_field="prompt")), "no field 'prompt'; it has question, answer"),
    (dict(folder=True, options=dict(split="test")), "has no split 'test'; it has train"),
    (dict(options=dict(answer_extractor="last")), "answer_extractor = 'last': use one of gsm8k, boxed, none"),
    (dict(options=dict(messages_field="question")), "exactly one of task.options.prompt_field"),
    (dict(options=dict(verifier="numerc")), "did you mean numeric?"),
    (dict(suffix=".txt"), "unknown format '.txt'"),
    (dict(corrupt=True), "cannot read it"),
])
def test_bad_data_is_one_line_naming_file_row_field(change, fragment, tmp_path):
    path = tmp_path / f"data{change.get('suffix', '.parquet')}"
    if change.get("folder"):
        path = tmp_path / "saved"
        datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)).save_to_disk(str(path))
    elif change.get("corrupt") or change.get("suffix"):
        path.write_bytes(b"PAR1 not really parquet")
    else:
        gsm8k_parquet(path, change.get("rows", ROWS))
    options = {**GSM8K, **change.get("options", {})}
    if "messages_field" in change.get("options", {}):
        options["prompt_field"] = "question"
    with pytest.raises(ValueError) as e:
        make_task("hf_dataset", path=str(path), **options)
    message = str(e.value)
    assert fragment in message and "\n" not in message, message
    if "row" in fragment:
        assert str(path) in message


def test_gsm8k_run_trains_and_exports_on_finish(logged_run):
    run, rows = logged_run
    assert [r["update"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    summary = (run / "summary.json").read_text()
    assert '"updates": 2' in summary
    export = run / "export"
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    from safetensors.torch import load_file

    from nemo_rz.models.hf import load_hf
    from nemo_rz.runtime import checkpoint

    weights = load_file(checkpoint.latest(run / "checkpoints") / "model.safetensors")
    exported = load_hf(export).state_dict()
    assert exported.keys() == weights.keys() and all((exported[k] == weights[k]).all() for k in weights)
