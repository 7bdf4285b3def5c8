"""Hugging Face tokenizers behind the task interface: chat rendering, BOS policy, EOS ids, checkpoint wiring,
and zero mismatch on chat-formatted prompts. The tokenizers are real (the `tokenizers` library), built in
memory (tests/tiny_hf.py); models are tiny and random."""
import json
from collections.abc import Mapping

import pytest
import torch

pytest.importorskip("transformers")

from conftest import count_diff, tiny_model  # noqa: E402
from tiny_hf import CHATML, bpe_tokenizer, llama_checkpoint, word_tokenizer  # noqa: E402

from nemo_rz import extras, ops  # noqa: E402
from nemo_rz.generation import RolloutEngine, SamplingParams  # noqa: E402
from nemo_rz.tasks import CharTokenizer, HFTokenizer, jsonl_task, make_task  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer(bpe_tokenizer())


def test_interface_and_round_trip(tok):
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.eos_ids, tok.pad_id, tok.add_bos) == (320, 0, 2, (2,), 3, False)
    text = "What is 17 + 25? ☃ ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode(text, bos=True, eos=True) == [0] + ids + [2]
    assert tok.decode(ids + [2] + tok.encode(" ignored")) == text            # stops at EOS
    assert tok.decode(ids + [2] + tok.encode("x"), stop_at_eos=False) == text + "x"
    with pytest.raises(ValueError, match="token id 999 at position 1 is outside the vocabulary"):
        tok.decode([5, 999])


def test_chat_rendering(tok):
    raw = tok.tok.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    assert isinstance(raw, (Mapping, list))                  # transformers 5: a mapping; 4.x: a list
    ids = tok.chat(MESSAGES)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.tok.decode(ids) == RENDERED and ids == tok.encode(RENDERED)
    assert tok.tok.decode(tok.chat(MESSAGES, add_generation_prompt=False)) == RENDERED[: -len("<|im_start|>assistant\n")]
    bad = HFTokenizer(bpe_tokenizer(chat_template="{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(ValueError, match="chat template .* refused the messages: .*roles must alternate"):
        bad.chat(MESSAGES)
    with pytest.raises(ValueError, match="has no chat template"):
        HFTokenizer(bpe_tokenizer(chat_template=None)).chat(MESSAGES)
    with pytest.raises(ValueError, match="character tokenizer has no chat template"):
        CharTokenizer().chat(MESSAGES)


def test_bos_policy():
    adds = HFTokenizer(bpe_tokenizer(bos=True))               # the tokenizer adds BOS by itself: policy on
    assert adds.add_bos and adds.chat(MESSAGES)[:2] == [0, 1] and adds.chat(MESSAGES)[1:] == adds.encode(RENDERED)
    declared = HFTokenizer(bpe_tokenizer(), add_bos=True)     # declared by the checkpoint (e.g. GGUF metadata)
    assert declared.chat(MESSAGES) == [0] + declared.encode(RENDERED)
    own = HFTokenizer(bpe_tokenizer(chat_template="{{ bos_token }}" + CHATML), add_bos=True)
    assert own.chat(MESSAGES)[:2] == [0, 1]                   # the template wrote BOS: not doubled
    off = HFTokenizer(bpe_tokenizer(bos=True), add_bos=False)  # negative control: policy off, no BOS
    assert off.chat(MESSAGES)[0] == 1
    task = make_task("add1", tokenizer=declared, chat_template=False)
    assert task.encode_prompt("1+2=") == [0] + declared.encode("1+2=")


def test_unencodable_text():
    w = HFTokenizer(word_tokenizer(["What", "is", "1", "+", "2", "?"]))
    assert w.encode("What is 1 + 2 ?") == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match=r"cannot encode 'What is 3': part of it maps to the unknown token '\[UNK\]'"):
        w.encode("What is 3")


def test_task_rendering(tok, tmp_path):
    task = make_task("add2", tokenizer=tok, system_prompt="Be brief.", n_train=20, n_heldout=5)
    assert task.chat and task.train[0].prompt.startswith("What is ") and task.train[0].prompt.endswith("? Answer with just the number.")
    ids = task.encode_prompt(task.train[0].prompt)
    assert tok.tok.decode(ids) == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{task.train[0].prompt}<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    a, b = task.train[0].prompt.removeprefix("What is ").split("?")[0].split(" + ")
    assert task.train[0].answer == str(int(a) + int(b))
    assert task.reward(tok.encode(f"{a} + {b} = {task.train[0].answer}", eos=True), task.train[0].answer) == 1.0
    assert task.reward(tok.encode(f"{a} + {b} = {task.train[0].answer}"), task.train[0].answer) == 0.0   # no EOS
    plain = make_task("add2", tokenizer=tok, chat_template=False, n_train=20, n_heldout=5)
    assert not plain.chat and plain.train[0].prompt.endswith("=") and plain.encode_prompt("1+2=") == tok.encode("1+2=")
    assert plain.reward(tok.encode(" 3", eos=True), "3") == 0.0 and plain.reward(tok.encode("3", eos=True), "3") == 1.0
    rev = make_task("reverse", tokenizer=tok, n_train=20, n_heldout=5)
    p = rev.train[0]
    assert rev.reward(tok.encode(f"The reverse is {p.answer}.", eos=True), p.answer) == 1.0
    with pytest.raises(ValueError, match="system_prompt needs chat prompts"):
        make_task("add2", tokenizer=tok, chat_template=False, system_prompt="x")
    with pytest.raises(ValueError, match="chat_template=true but the tokenizer has no chat template"):
        make_task("add2", chat_template=True)
    with pytest.raises(ValueError, match="chat_template = 'maybe': use auto, true or false"):
        make_task("add2", tokenizer=tok, chat_template="maybe")
    # JSONL: messages rows keep their own system message; a prompt row becomes a user turn
    rows = [{"messages": [{"role": "system", "content": "Own."}, {"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)}
            for i in range(9)] + [{"prompt": "2+2?", "answer": "4"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = jsonl_task(str(path), tokenizer=tok, system_prompt="Be brief.", heldout_fraction=0.2, verifier="numeric")
    texts = {tok.tok.decode(data.encode_prompt(p.prompt)) for p in data.train + data.heldout}
    assert "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n" in texts
    assert sum(t.startswith("<|im_start|>system\nOwn.<|im_end|>") for t in texts) == 9
    with pytest.raises(ValueError, match=r"d.jsonl:\d: a chat-messages prompt needs chat rendering"):
        jsonl_task(str(path), tokenizer=tok, chat_template=False)
    with pytest.raises(ValueError, match=r"d.jsonl:\d: a chat-messages prompt needs chat rendering"):
        jsonl_task(str(path))                                 # the character tokenizer has no template


def test_from_pretrained_directory(tmp_path):
    path = llama_checkpoint(tmp_path / "ckpt", bpe_tokenizer(), eos_token_id=[2, 0])
    tok = HFTokenizer.from_pretrained(path)
    assert tok.eos_ids == (2, 0) and tok.eos_id == 2 and not tok.add_bos and tok.vocab_size == 320
    assert tok.chat(MESSAGES) == HFTokenizer(bpe_tokenizer()).chat(MESSAGES)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert HFTokenizer.from_pretrained(path).add_bos                     # the declared policy wins
    (tmp_path / "empty").mkdir()
    for bad, match in [(tmp_path / "empty", "no tokenizer files"), (tmp_path / "none", "does not exist"),
                       (path / "config.json", "is a file but not a .gguf file")]:
        with pytest.raises(ValueError, match=match) as e:
            HFTokenizer.from_pretrained(bad)
        assert "\n" not in str(e.value)


def test_missing_package_is_one_line(monkeypatch, tmp_path):
    path = llama_checkpoint(tmp_path / "ckpt", bpe_tokenizer())
    real = extras.importlib.util.find_spec
    monkeypatch.setattr(extras.importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ValueError, match=r'needs the Python package\(s\) transformers: pip install "nemo-rz\[hf\]"'):
        HFTokenizer.from_pretrained(path)


def test_generation_stops_on_every_eos_id(tok):
    """The engine stops at the first of eos_ids. The model is rigged so that one hidden unit alone reaches the
    head, which maps its sign to one EOS id or the other: both ids come up often. Negative control: with only
    the tokenizer's EOS as stop id, completions run on past the generation config's second EOS."""
    two = HFTokenizer(bpe_tokenizer(), eos_ids=(0,))
    assert two.eos_ids == (2, 0)
    model = tiny_model(vocab_size=two.vocab_size)
    with torch.no_grad():
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[0, 0], model.lm_head.weight[2, 0] = 3.0, -3.0
    engine = RolloutEngine(model, max_batch_size=32, max_model_len=96)
    prompts = [two.chat([{"role": "user", "content": f"What is {i} + 1?"}]) for i in range(32)]

    def run(stop):
        return engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop_token_ids=stop))

    outs = run(two.eos_ids)
    for o in outs:
        assert not set(o.token_ids[:-1]) & set(two.eos_ids)                     # nothing after the first EOS
        assert (o.finish_reason == "stop") == (o.token_ids[-1] in two.eos_ids)
    assert {o.token_ids[-1] for o in outs if o.finish_reason == "stop"} == {0, 2}  # each id ended some completion
    control = run((two.eos_id,))
    assert any(0 in o.token_ids[:-1] for o in control)
    task = make_task("add1", tokenizer=two, n_train=20, n_heldout=5)
    assert task.completion_text(two.encode("7", eos=False) + [0] + two.encode("9")) == "7"


def test_zero_mismatch_chat_prompts_shared_system_prompt(tok, tmp_path):
    """Chat prompts of mixed lengths behind one shared system prompt: the prefix cache reuses the shared part,
    and the learner still scores every generated token bit-identically. Fast kernels are the negative control."""
    rows = [{"prompt": "What is " + " + ".join(str(7 * j + i) for j in range(1 + i % 5)) + "?", "answer": "1"}
            for i in range(12)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = jsonl_task(str(path), tokenizer=tok, heldout_fraction=0.2,
                      system_prompt="You are a careful assistant. Answer with just the number. " * 3)
    prompts = [task.encode_prompt(p.prompt) for p in task.train for _ in range(2)]
    assert len({len(p) for p in prompts}) >= 4                             # mixed lengths
    model = tiny_model(vocab_size=tok.vocab_size)
    for mode, expect_zero in (("consistent", True), ("fast", False)):
        with ops.use_kernels(mode):
            engine = RolloutEngine(model, max_batch_size=5, max_model_len=task.validate() + 24)
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=1.0, seed=11,
                                                           stop_token_ids=tok.eos_ids))
            diff, n = count_diff(model, outs)
        assert engine.stats["prefix_hit_tokens"] > 0 and n > 100
        assert (diff == 0) == expect_zero, (mode, diff, n)


def test_trainer_uses_the_checkpoint_tokenizer(tmp_path):
    """model.hf_path with tokenizer files: chat prompts, jobs stop on every EOS id, zero kernel mismatch."""
    from nemo_rz import config
    from nemo_rz.runtime.trainer import Trainer

    path = llama_checkpoint(tmp_path / "ckpt", bpe_tokenizer(), eos_token_id=[2, 0])
    cfg = config.load(None, [f"model.hf_path={path}", "task.name=add1", "task.system_prompt=Be brief.", "warmup.steps=0",
                             "algo.updates=2", "algo.prompts_per_update=2", "algo.group_size=2", "algo.max_new_tokens=8",
                             "algo.lr=1e-4", "eval.n=4", "progress=false", "metrics.tensorboard=false",
                             "metrics.decomposition_every=1", "checkpoint.every=0", f"run_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    trainer = Trainer(cfg, tmp_path / "run", log=lambda *a: None)
    assert isinstance(trainer.tok, HFTokenizer) and trainer.task.chat
    job = trainer.job(0)
    assert job.stop_token_ids == (2, 0)
    assert trainer.tok.tok.decode(job.prompts[0]).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is ")
    summary = trainer.run()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["updates"] == 2 and [r["kernel_diff_tokens"] for r in rows] == [0, 0]
    char = Trainer(config.load(None, [*cfg_overrides(cfg), "model.tokenizer=char"]), tmp_path / "run2", log=lambda *a: None)
    assert isinstance(char.tok, CharTokenizer) and not char.task.chat


def cfg_overrides(cfg) -> list[str]:
    return [f"model.hf_path={cfg.model.hf_path}", "task.name=add1", "warmup.steps=0", "eval.n=4", "progress=false",
            "metrics.tensorboard=false", "algo.max_new_tokens=8"]


# -- chat templates: rendered as transformers renders them, within bounds -------------------------------------
KITCHEN_SINK = r"""{%- set ns = namespace(last_user=-1, tools=[]) %}
{%- for m in messages[::-1] %}{%- if ns.last_user < 0 and m.role == 'user' %}
{%- set ns.last_user = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}
{%- macro show(m, i) -%}[{{ i }}/{{ messages|length }}] {{ m['role']|upper }}{{ ':' ~ ' ' }}{{ m.content|trim }}
{%- if m.extra is defined %} {{ m.extra|tojson }}{% endif %}{%- endmacro %}
{{- bos_token }}{% if messages[0].role == 'system' %}<<SYS>>{{ messages[0].content.split(' ')|join('_') }}<</SYS>>
{% endif %}
{%- for m in messages if m.role != 'system' %}
{%- if loop.first %}{{ '%s/%d' % ('turns', loop.length) }}
{% endif %}
{%- generation %}{{ show(m, loop.index) }}{% endgeneration %}{{ '\n' if not loop.last else '' }}
{%- if loop.index0 == ns.last_user - 1 %}<<last user next>>{% endif %}
{%- if m.content.startswith('skip') %}{% continue %}{% endif %}
{%- set pad = '-' * (loop.index % 3) %}{{ pad }}{{ '{:>4}'.format(loop.index) }}{{ m.content|replace('1', 'one')|center(12)|length }}
{%- if m.content == 'stop' %}{% break %}{% endif %}
{% endfor %}
{%- set items = {'b': 2, 'a': [1, 2.5, none, true, 'ü']} %}{{ items|tojson }}{{ items|tojson(indent=2) }}
{%- for k, v in items|dictsort %}{{ k }}={{ v }};{% endfor %}{{ (messages|map(attribute='role')|unique|list|length) ** 2 }}
{%- for chunk in 'abcdefg'|batch(3, 'x') %}{{ chunk|join }}{% endfor %}{{ range(5)|slice(2)|list }}{{ 'a b c'|wordwrap(2) }}
{%- set captured %}{% filter upper %}captured {{ eos_token }}{% endfilter %}{% endset %}{{ captured|indent(2, true) }}
{%- if add_generation_prompt %}{{ '<|assistant|>' + '\n' }}{% endif %}"""
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief and kind."}, {"role": "user", "content": "What is 1 + 2?"},
     {"role": "assistant", "content": " 3 ", "extra": {"k": [1, "ü"]}}, {"role": "user", "content": "skip me 11"},
     {"role": "user", "content": "stop"}, {"role": "user", "content": "never"}],
]


@pytest.mark.parametrize("template", [CHATML, KITCHEN_SINK], ids=["chatml", "kitchen sink"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one turn", "many turns"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_bounded_rendering_matches_transformers(template, messages, add_generation_prompt):
    tok = HFTokenizer(bpe_tokenizer(chat_template=template))
    expected = tok.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok._render(messages, add_generation_prompt) == expected
    assert tok.chat(messages, add_generation_prompt) == tok.encode(expected)


_DOUBLING = "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}{{ ns.s|length }}"
RUNAWAY_TEMPLATES = {  # a template from the model files that would take the machine's time or memory
    "nested loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
                     "loop iterations and calls"),
    "string repetition": ("{{ 'x' * 3000000000 }}", "a repeated value of 3000000000 characters"),
    "repetition on the right": ("{{ 3000000000 * 'x' }}", "a repeated value of"),
    "list repetition": ("{{ ([1, 2] * 1000000000)|length }}", "a repeated value of"),
    "shared lists": ("{% set l = range(100000)|list %}{{ ([l] * 1000)|length }}", "a repeated value of"),
    "doubling with ~": (_DOUBLING.replace("OP", "~"), "a concatenated string of"),
    "doubling with +": (_DOUBLING.replace("OP", "+"), "a sum of"),
    "printf width": ("{{ '%1000000000s' % 'x' }}", "a formatted string of"),
    "printf star width": ("{{ '%*s' % (1000000000, 'x') }}", "a formatted string of"),
    "format width": ("{{ '{:>1000000000}'.format(1) }}", "a formatted string of"),
    "format nested width": ("{{ '{:>{w}}'.format(1, w=1000000000) }}", "a formatted string of"),
    "format filter": ("{{ '%1000000000d'|format(1) }}", "a formatted string of"),
    "center filter": ("{{ 'x'|center(1000000000) }}", "center's result of"),
    "indent filter": ("{{ ('a\n' * 1000)|indent(1000000) }}", "indent's result of"),
    "ljust method": ("{{ 'x'.ljust(1000000000) }}", "str.ljust's result of"),
    "replace filter": ("{{ ('a' * 1000)|replace('a', 'b' * 100000) }}", "a replaced string of"),
    "replace method": ("{{ ('a' * 1000).replace('', 'b' * 100000) }}", "a replaced string of"),
    "join filter": ("{% set s = 'x' * 100000 %}{{ ([s] * 10)|join('y' * 100000) }}", "join's result of"),
    "join method": ("{% set s = 'x' * 100000 %}{{ ('y' * 100000).join([s] * 10) }}", "str.join's result of"),
    "batch fill": ("{{ [1]|batch(1000000000, 0)|list|length }}", "batch's line count of"),
    "power": ("{{ 10 ** 1000000000 }}", "a power of"),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "output of"),
    "literal text in a set block": ("{% set s %}{% for i in range(100000) %}" + "y" * 200 + "{% endfor %}{% endset %}",
                                    "output of"),
    "macro output": ("{% macro m() %}{% for i in range(100000) %}" + "z" * 200 + "{% endfor %}{% endmacro %}{% set _ = m() %}",
                     "output of"),
    "tojson indent": ("{{ range(100000)|list|tojson(indent=100) }}", "tojson's result of"),
}


@pytest.mark.parametrize("case", list(RUNAWAY_TEMPLATES))
def test_runaway_chat_templates_stop_within_bounds(case):
    import time

    template, message = RUNAWAY_TEMPLATES[case]
    tok = HFTokenizer(bpe_tokenizer(chat_template=template))
    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        tok.chat(MESSAGES)
    assert time.monotonic() - start < 8  # the render bounds, not the machine, stopped it
    text = str(info.value)
    assert "\n" not in text and "went past its render bound" in text and message in text, text
    assert "fix the chat template" in text


def test_render_deadline(monkeypatch):
    """The time bound, for a template within the step and size bounds that is slow all the same."""
    from nemo_rz.tasks import hf_tokenizer

    monkeypatch.setattr(hf_tokenizer, "RENDER_SECONDS", 0.05)
    slow = "{% for i in range(900) %}{% set s = ('x' * 100000).replace('x', 'yy') %}{% endfor %}"
    with pytest.raises(ValueError, match=r"went past its render bound \(more than 0.05 s\)"):
        HFTokenizer(bpe_tokenizer(chat_template=slow)).chat(MESSAGES)


def test_templates_cannot_reach_around_the_bounds():
    """lipsum (n paragraphs) is gone; the sandbox still refuses attribute tricks."""
    for template, message in [("{{ lipsum(100000) }}", "UndefinedError"),
                              ("{{ ''.__class__.__mro__ }}", "refused the messages"),
                              ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "refused the messages")]:
        with pytest.raises(ValueError, match=message):
            HFTokenizer(bpe_tokenizer(chat_template=template)).chat(MESSAGES)


def test_bounds_grow_with_the_messages():
    """A long conversation is not refused: the step and size bounds grow with the input."""
    tok = HFTokenizer(bpe_tokenizer())
    long = [{"role": "user" if i % 2 else "assistant", "content": "What is 1 + 2? " * 2000} for i in range(64)]
    text = tok._render(long, True)
    assert len(text) > 1_900_000 and text == tok.tok.apply_chat_template(long, tokenize=False, add_generation_prompt=True)
