"""Tokenizer, synthetic tasks, JSONL datasets, verifiers and reward plumbing."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rz.tasks import TASKS, CharTokenizer, evaluate_pass_at_1, jsonl_task, load_jsonl, make_task, safe_reward
from nemo_rz.tasks.tokenizer import DEFAULT_CHARS
from nemo_rz.tasks.verifiers import VERIFIERS, exact, numeric

TOK = CharTokenizer()


# ---------------------------------------------------------------- tokenizer

@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=DEFAULT_CHARS, max_size=30))
def test_tokenizer_round_trip(s):
    ids = TOK.encode(s)
    assert len(ids) == len(s) and all(3 <= i < TOK.vocab_size for i in ids)
    assert TOK.decode(ids) == s
    assert TOK.decode(TOK.encode(s, bos=True, eos=True)) == s


def test_tokenizer_ids_and_specials():
    assert (TOK.pad_id, TOK.bos_id, TOK.eos_id) == (0, 1, 2)
    assert TOK.vocab_size == 3 + len(DEFAULT_CHARS)
    assert TOK.encode("0") == [3] and TOK.encode("12+3=") == [4, 5, 13, 6, 16]   # fixed: never data-dependent
    assert TOK.encode("1", bos=True, eos=True) == [1, 4, 2]
    # decode skips PAD/BOS and stops at the first EOS (or skips EOS when asked not to stop)
    assert TOK.decode([1, 4, 0, 5, 2, 6]) == "12"
    assert TOK.decode([4, 2, 6], stop_at_eos=False) == "13"


def test_tokenizer_errors():
    with pytest.raises(ValueError, match=r"unknown character '\?' at position 2 of '12\?'"):
        TOK.encode("12?")
    with pytest.raises(ValueError, match="token id 99 at position 1"):
        TOK.decode([4, 99])
    with pytest.raises(ValueError, match="appears twice"):
        CharTokenizer("abca")


# ---------------------------------------------------------------- synthetic tasks

@pytest.mark.parametrize("name", ["add1", "add2", "add3", "mul1", "mul2", "reverse"])
def test_splits_disjoint_deterministic(name):
    kw = {"n_train": 2000, "n_heldout": 200} if name in ("add3", "reverse") else {}
    a, b, c = make_task(name, seed=1, **kw), make_task(name, seed=1, **kw), make_task(name, seed=2, **kw)
    train, held = {p.prompt for p in a.train}, {p.prompt for p in a.heldout}
    assert len(train) == len(a.train) and len(held) == len(a.heldout) > 0     # no duplicates
    assert not train & held                                                   # held-out disjoint from train
    assert a.train == b.train and a.heldout == b.heldout                      # same seed -> same splits
    assert a.heldout != c.heldout                                             # another seed -> other splits


def test_answers_are_right():
    for name in ("add1", "add2", "mul1", "mul2"):
        task = make_task(name)
        for p in task.train[:200] + task.heldout:
            assert p.prompt.endswith("=") and str(eval(p.prompt[:-1])) == p.answer
    task = make_task("reverse", min_len=2, max_len=3)
    lengths = set()
    for p in task.train + task.heldout:
        s = p.prompt[len("rev "):-1]
        assert p.answer == s[::-1] and len(s) in (2, 3)
        lengths.add(len(s))
    assert lengths == {2, 3}
    assert len(task.train) + len(task.heldout) == 100 + 1000   # every 2- and 3-digit string (defaults take all)
    assert make_task("add1").tokenizer.vocab_size == TOK.vocab_size


def test_verifier_exact_match_up_to_eos():
    task = make_task("add1")
    ans = "14"
    good = task.encode_answer(ans)
    assert good == TOK.encode("14") + [TOK.eos_id]
    assert task.reward(good, ans) == 1.0
    assert task.reward(good + TOK.encode("99"), ans) == 1.0          # what follows EOS is ignored
    assert task.reward(TOK.encode("14"), ans) == 0.0                  # no EOS: out of budget earns 0
    assert task.reward(TOK.encode("15") + [TOK.eos_id], ans) == 0.0
    assert task.reward(TOK.encode("140") + [TOK.eos_id], ans) == 0.0  # exact, not prefix
    assert task.reward(TOK.encode(" 14") + [TOK.eos_id], ans) == 0.0  # format counts
    assert task.reward("14", ans) == 1.0                              # already-decoded text
    assert task.encode_prompt("1+2=") == [TOK.bos_id] + TOK.encode("1+2=")


def test_make_task_errors():
    with pytest.raises(ValueError, match=r"unknown task 'ad1' \(did you mean add1\?\)"):
        make_task("ad1")
    with pytest.raises(ValueError, match="unknown option.*n_test.*valid are"):
        make_task("add2", n_test=3)
    with pytest.raises(ValueError, match="cannot draw"):
        make_task("add1", n_train=100, n_heldout=20)
    assert {"add1", "add2", "add3", "reverse", "jsonl"} <= set(TASKS)


# ---------------------------------------------------------------- JSONL

def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_jsonl_load_and_task(tmp_path):
    rows = [json.dumps({"prompt": f"what is {i}+{i}?", "answer": str(2 * i)}) for i in range(20)]
    rows.insert(3, "")                                    # blank lines are skipped
    rows.append(json.dumps({"prompt": "half of 3?", "answer": 1.5}))
    path = write(tmp_path, rows)
    probs = load_jsonl(path)
    assert len(probs) == 21 and probs[-1].answer == "1.5" and probs[0].prompt == "what is 0+0?"
    task = jsonl_task(path, verifier="numeric", seed=3, heldout_fraction=0.2)
    assert len(task.heldout) == 4 and len(task.train) == 17
    assert not {p.prompt for p in task.train} & {p.prompt for p in task.heldout}
    assert task.heldout == jsonl_task(path, verifier="numeric", seed=3, heldout_fraction=0.2).heldout
    assert "?" in task.tokenizer.chars                     # the alphabet grows to cover the data, sorted
    p = task.heldout[0]
    assert task.reward(task.encode_answer(p.answer), p.answer) == 1.0
    held = write(tmp_path, [json.dumps({"prompt": "1+1?", "answer": "2"})], "h.jsonl")
    assert [q.prompt for q in jsonl_task(path, heldout_path=held).heldout] == ["1+1?"]


@pytest.mark.parametrize("line, match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"prompt": "x"}', "missing key 'answer'"),
    ('{"prompt": "", "answer": "1"}', "'prompt' must be a non-empty string"),
    ('{"prompt": "x", "answer": [1]}', "'answer' must be a string or a number"),
    ('{"prompt": "x", "answer": true}', "'answer' must be a string or a number"),
])
def test_jsonl_bad_lines(tmp_path, line, match):
    path = write(tmp_path, ['{"prompt": "a", "answer": "1"}', "", line])
    with pytest.raises(ValueError, match=match) as e:
        load_jsonl(path)
    assert str(e.value).startswith(f"{path}:3: ") and "\n" not in str(e.value)


def test_jsonl_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no examples found"):
        load_jsonl(write(tmp_path, [""]))
    path = write(tmp_path, ['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": "seven"}'])
    with pytest.raises(ValueError, match=r"d.jsonl:2: numeric verifier: answer 'seven' is not a number; use the exact"):
        jsonl_task(path, verifier="numeric", heldout_fraction=0.5)
    with pytest.raises(ValueError, match="unknown verifier 'fuzzy'"):
        jsonl_task(path, verifier="fuzzy")


def test_verifiers():
    assert exact(" 42 ", "42") == 1.0 and exact("42.0", "42") == 0.0
    assert numeric("42.0", "42") == 1.0 and numeric("1,000", "1000") == 1.0
    assert numeric("0.3333333", "0.33333333") == 1.0 and numeric("0.33", "0.3333") == 0.0
    assert numeric("abc", "42") == 0.0 and numeric("nan", "42") == 0.0 and numeric("", "0") == 0.0
    with pytest.raises(ValueError, match="is not a number"):
        numeric("1", "one")


@pytest.mark.parametrize("verifier, text, answer, reward", [
    # numeric reads the last number of the response
    ("numeric", "17 + 25 = 42", "42", 1.0),
    ("numeric", "The answer is 42.", "42", 1.0),
    ("numeric", "42, no wait, 43", "42", 0.0),
    ("numeric", "It is 1,234,567 in total", "1234567", 1.0),
    ("numeric", "-3.5e2 degrees", "-350", 1.0),
    ("numeric", "x = 1e999", "1", 0.0),                   # overflow is not a number
    ("numeric", "\ufffd\ufffd\x00", "0", 0.0),        # garbage bytes: no number, reward 0
    ("digits", "reversed: 021", "021", 1.0),
    ("digits", "reversed: 21", "021", 0.0),               # leading zeros count
    ("digits", "", "021", 0.0),
    ("boxed", "so \\boxed{\\frac{1}{2}} and finally \\boxed{42}", "42", 1.0),
    ("boxed", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),   # nested braces
    ("boxed", "\\boxed{42.0}", "42", 1.0),               # numbers compare as numbers
    ("boxed", "\\boxed{41} then \\boxed{42", "42", 0.0),     # the unclosed last box is skipped: 41
    ("boxed", "\\boxed{42} then \\boxed{4", "42", 1.0),
    ("boxed", "42", "42", 0.0),                           # no box
    ("boxed", "\\boxed{}", "42", 0.0),
])
def test_verifier_cases(verifier, text, answer, reward):
    assert VERIFIERS[verifier](text, answer) == reward


def test_math_verifier(monkeypatch):
    pytest.importorskip("math_verify")
    math = VERIFIERS["math"]
    assert math("so the answer is $\\frac{1}{2}$", "0.5") == 1.0
    assert math("17 + 25 = 42", "42") == 1.0 and math("17 + 25 = 32", "42") == 0.0
    assert math("no idea", "42") == 0.0 and math("", "\\frac{1}{2}") == 0.0
    from nemo_rz import extras

    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda n, *a: None if n == "math_verify" else real(n, *a))
    with pytest.raises(ValueError, match=r'math verifier needs the Python package\(s\) math-verify: pip install "nemo-rz\[math\]"'):
        math("42", "42")


# ---------------------------------------------------------------- reward plumbing

def test_safe_reward():
    assert safe_reward(lambda c, a: 1.0 if c == a else 0.0, "4", "4") == (1.0, None)
    r, err = safe_reward(lambda c, a: 1 / 0, "4", "4")
    assert r == 0.0 and err.startswith("ZeroDivisionError")
    assert safe_reward(lambda c, a: float("nan"), "4", "4")[0] == 0.0
    assert "not finite" in safe_reward(lambda c, a: float("inf"), "4", "4")[1]
    assert "not a number" in safe_reward(lambda c, a: "yes", "4", "4")[1]
    assert safe_reward(lambda c, a: True, "4", "4") == (1.0, None)


def test_evaluate_pass_at_1():
    task = make_task("add1", n_train=50, n_heldout=10)
    answers = {tuple(task.encode_prompt(p.prompt)): p.answer for p in task.heldout}
    calls = []

    def oracle_half(prompts):   # right on every other problem, wrong on the rest
        calls.append(len(prompts))
        return [task.encode_answer(answers[tuple(x)] if i % 2 == 0 else "x") for i, x in enumerate(prompts)]

    out = evaluate_pass_at_1(oracle_half, task, batch_size=4)
    assert calls == [4, 4, 2]
    assert out == {"pass_at_1": 0.5, "n": 10, "reward_errors": 0, "first_error": None}   # 2+2+1 right of 10
    assert evaluate_pass_at_1(oracle_half, task, limit=4)["n"] == 4
    # a completion the tokenizer cannot decode costs that sample and is counted, not raised
    out = evaluate_pass_at_1(lambda ps: [[999, TOK.eos_id] for _ in ps], task)
    assert out["pass_at_1"] == 0.0 and out["reward_errors"] == 10 and "token id 999" in out["first_error"]
    with pytest.raises(ValueError, match="returned 0 completions for 10 prompts"):
        evaluate_pass_at_1(lambda ps: [], task)


# ---------------------------------------------------------------- data limits (refused before training)

def _rows(n):
    return [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(n)]


def _data_case(tmp_path, case):
    """(task.options overrides, the text the one-line error must contain) for a bad-data case."""
    path = tmp_path / "d.jsonl"
    if case == "no path":
        return [], "needs task.options.path: set task.options.path=FILE.jsonl"
    if case == "missing":
        return [f"task.options.path={tmp_path / 'nope.jsonl'}"], "nope.jsonl: no such file"
    if case == "directory":
        return [f"task.options.path={tmp_path}"], "is a directory; give the path of a JSONL file"
    if case == "not utf-8":
        path.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
        return [f"task.options.path={path}"], "d.jsonl:2: not UTF-8 text (byte 0xe9 at column 16)"
    if case == "one row":
        path.write_text(_rows(1)[0] + "\n")
        return [f"task.options.path={path}"], "1 example(s) leave none to train on"
    if case == "no held-out":
        path.write_text("\n".join(_rows(10)) + "\n")
        return [f"task.options.path={path}", "task.options.heldout_fraction=0"], "heldout_fraction must be in (0, 1)"
    if case == "huge line":   # 2 MB of prompt: refused by length before any model work (issue: 10 MB -> 5.4 GB)
        path.write_text("\n".join(_rows(4) + [json.dumps({"prompt": "1+" * 1_000_000 + "1=", "answer": "2"})]) + "\n")
        return [f"task.options.path={path}"], "d.jsonl:5: the prompt is 2000003 tokens, over the 58 that fit"
    if case == "bad messages":
        path.write_text("\n".join(_rows(4) + [json.dumps({"messages": [{"role": "user"}], "answer": "2"})]) + "\n")
        return [f"task.options.path={path}"], "d.jsonl:5: messages[0] must be an object with exactly 'role' and 'content'"
    if case == "no answer":
        path.write_text("\n".join(_rows(4) + [json.dumps({"prompt": "1+1="})]) + "\n")
        return [f"task.options.path={path}"], "d.jsonl:5: missing key 'answer'"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["no path", "missing", "directory", "not utf-8", "one row", "no held-out", "huge line",
                                  "bad messages", "no answer"])
def test_bad_data_is_one_line_before_training(tmp_path, capsys, case):
    from nemo_rz import train

    options, expected = _data_case(tmp_path, case)
    rc = train.main(["task.name=jsonl", *options, f"run_dir={tmp_path / 'run'}", "progress=false",
                     "metrics.tensorboard=false", "warmup.steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_few_rows_train(tmp_path):
    """Three rows hold one out and train on two (five or fewer rows used to fail after the warm-up)."""
    from nemo_rz import train

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(_rows(3)) + "\n")
    rc = train.main(["task.name=jsonl", f"task.options.path={path}", f"run_dir={tmp_path / 'run'}", "progress=false",
                     "metrics.tensorboard=false", "warmup.steps=2", "algo.updates=1", "algo.prompts_per_update=2",
                     "algo.group_size=2", "checkpoint.every=0"])
    assert rc == 0 and json.loads((tmp_path / "run" / "summary.json").read_text())["updates"] == 1


# ---------------------------------------------------------------- typed options, BOM, repeated rows

@pytest.mark.parametrize("name, options, match", [
    ("jsonl", {"heldout_fraction": "abc"}, r"task.options.heldout_fraction = 'abc': expected a finite number \(task jsonl\)"),
    ("jsonl", {"require_eos": "maybe"}, "task.options.require_eos = 'maybe': expected true or false"),
    ("jsonl", {"seed": [1, 2]}, r"task.options.seed = \[1, 2\]: expected an integer >= 0"),
    ("add2", {"n_train": "abc"}, "task.options.n_train = 'abc': expected an integer in 1..1000000, or null"),
    ("add2", {"n_heldout": 0}, "task.options.n_heldout = 0: expected an integer in 1..1000000.*hold out at least 1"),
    ("add2", {"n_train": 2.5}, "task.options.n_train = 2.5"),
    ("add2", {"seed": True}, "task.options.seed = True: expected an integer"),
    ("reverse", {"max_len": 100_000}, r"task.options.max_len = 100000: expected an integer in 1..512"),
    ("reverse", {"min_len": 4, "max_len": 3}, "task.options.min_len = 4 is more than task.options.max_len = 3"),
])
def test_task_options_are_typed_per_task(name, options, match):
    with pytest.raises(ValueError, match=match) as e:
        make_task(name, **options)
    assert "\n" not in str(e.value)


def test_task_options_are_normalised(tmp_path):
    from nemo_rz.plugins import load
    from nemo_rz.tasks import options

    path = write(tmp_path, _rows(3))
    assert options.check("jsonl", load("task", "jsonl"), {"heldout_fraction": 1, "name": 2024, "path": path,
                                                          "heldout_path": path}) == \
        {"heldout_fraction": 1.0, "name": "2024", "path": path, "heldout_path": path}
    assert options.check("add2", load("task", "add2"), {"n_train": None}) == {"n_train": None}

    @options.limits(k=options.Range(1, 3))
    def plugin_task(k: int = 1, scale=0.5, anything=None, tokenizer=None, chat_template="auto", system_prompt=None):
        ...

    assert options.check("p", plugin_task, {"k": 3, "scale": 2, "anything": [1]}) == {"k": 3, "scale": 2.0, "anything": [1]}
    with pytest.raises(ValueError, match=r"task.options.k = 4: expected an integer in 1..3 \(task p\)"):
        options.check("p", plugin_task, {"k": 4})
    with pytest.raises(ValueError, match="task.options.scale = 'x': expected a finite number"):
        options.check("p", plugin_task, {"scale": "x"})


def test_split_indices_refuses_no_heldout():
    from nemo_rz.tasks.base import split_indices

    with pytest.raises(ValueError, match="n_heldout = 0: hold out at least 1 problem"):
        split_indices(100, 10, 0, 0, "task add1")


def test_jsonl_accepts_a_utf8_bom(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes("\ufeff".encode() + ("\n".join(_rows(5)) + "\n").encode())
    probs = load_jsonl(path)
    assert len(probs) == 5 and probs[0].prompt == "0+1="
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n' + "\ufeff".encode() + b'{"prompt": "b", "answer": "1"}\n')
    with pytest.raises(ValueError, match="bom.jsonl:2: not valid JSON"):  # only the file's first bytes may be a BOM
        load_jsonl(path)


def test_jsonl_rows_that_cannot_be_read(tmp_path):
    deep = '{"prompt": "1=", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}"
    for line, match in [(deep, "nested too deeply to read"),
                        ('{"prompt": "1=", "answer": ' + "7" * 5000 + "}", "a number of 5000 digits"),
                        ('{"prompt": "1=", "answer": ' + "[" * 500 + "]" * 500 + "}", "'answer' must be a string or a number")]:
        path = write(tmp_path, _rows(3) + [line])
        with pytest.raises(ValueError, match=match) as e:
            load_jsonl(path)
        assert str(e.value).startswith(f"{path}:4: ") and "\n" not in str(e.value)
    assert load_jsonl(write(tmp_path, ['{"prompt": "1=", "answer": ' + "7" * 4000 + "}"]))[0].answer == "7" * 4000


def test_jsonl_reads_regular_files_only(tmp_path):
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, match in [("/dev/zero", "a device, not a regular file"), (fifo, "a FIFO, not a regular file")]:
        with pytest.raises(ValueError, match=f"task.options.path {path}: cannot read it \\({match}\\)"):
            load_jsonl(path)


def _old_split(problems, seed, fraction):
    """The split before repeated prompts were grouped: the same for data without repeats."""
    order = list(range(len(problems)))
    __import__("random").Random(seed).shuffle(order)
    k = max(1, int(round(fraction * len(problems))))
    return [problems[i] for i in order[k:]], [problems[i] for i in order[:k]]


def test_repeated_rows_never_leak_into_heldout(tmp_path, capsys):
    path = write(tmp_path, _rows(30))
    task = jsonl_task(path, seed=5, heldout_fraction=0.2)
    assert (task.train, task.heldout) == _old_split(load_jsonl(path), 5, 0.2)  # no repeats: the split of old
    assert capsys.readouterr().err == ""
    rows = _rows(30)
    path = write(tmp_path, rows + rows[:10] + rows[:10] + [json.dumps({"prompt": "3+1=", "answer": "5"})])
    task = jsonl_task(path, seed=5, heldout_fraction=0.2)
    held = [p.prompt for p in task.heldout]
    assert len(held) == len(set(held)) == 6 and not set(held) & {p.prompt for p in task.train}
    assert len(task.train) + sum(1 + 2 * (int(p.split("+")[0]) < 10) + (p == "3+1=") for p in held) == 51
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"warning: {path}: 21 row(s) repeat the prompt of an earlier row "
                                                   f"(first: {path}:31 repeats {path}:1)")
    held_path = write(tmp_path, [rows[0], rows[1]], "h.jsonl")
    task = jsonl_task(write(tmp_path, rows), heldout_path=held_path)
    assert {p.prompt for p in task.train}.isdisjoint(p.prompt for p in task.heldout) and len(task.train) == 28
    assert "2 row(s) ask a prompt of the held-out file" in capsys.readouterr().err
    with pytest.raises(ValueError, match="every row asks a prompt of the held-out file"):
        jsonl_task(write(tmp_path, rows[:2]), heldout_path=held_path)
