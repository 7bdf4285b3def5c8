"""A Hugging Face tokenizer behind the task tokenizer interface (tokenizer.py): the checkpoint's own ids and chat template.

HFTokenizer.from_pretrained takes a checkpoint directory (tokenizer files, optional generation_config.json) or a
.gguf file (tokenizer and template are in its metadata). What transformers leaves implicit is made explicit here:
  - eos_ids: the tokenizer's EOS plus every eos_token_id of generation_config.json (or the GGUF metadata), so
    generation stops where the model's own generate() would (e.g. <|im_end|> for chat models);
  - add_bos (the BOS policy): the checkpoint's declared add_bos_token (tokenizer_config.json, or GGUF
    tokenizer.ggml.add_bos_token), else whatever the tokenizer does on its own. transformers' GGUF tokenizer
    never adds BOS, although some GGUF models produce garbage without it;
  - chat() returns ids (transformers 5's apply_chat_template(tokenize=True) returns a mapping, 4.x a list).

The chat template comes with the model files, so it is rendered under bounds (render_chat_template): a template
that loops without end, repeats a string 3e9 times or otherwise grows past what its messages justify stops with
one clear error instead of taking the machine's time or memory. Within the bounds it renders as transformers'
apply_chat_template does (the same sandboxed jinja2 environment, filters and globals).
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from pathlib import Path

from nemo_rz.extras import GGUF, HF_TOKENIZER, require

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _ids(value) -> list[int]:
    """eos_token_id as configs write it: an int, a list of ints, or null."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


def _read_json(file: Path) -> dict:
    try:
        d = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {file}: {e}; fix or re-download the file") from None
    return d if isinstance(d, dict) else {}


# -- bounded chat template rendering ------------------------------------------------------------------------
class _TemplateLimit(Exception):
    """A chat template went past a render bound (steps, characters or seconds)."""


class RenderBudget:
    """What one render may spend: `steps` (loop iterations, calls and the work of size checks), `chars` (the
    largest string or container a template may build, and all it outputs together) and `seconds`."""

    def __init__(self, steps: int, chars: int, seconds: float):
        self.steps_left, self.chars, self.seconds = steps, chars, seconds
        self.steps, self.out = steps, 0
        self.deadline = time.monotonic() + seconds

    def step(self, n: int = 1) -> None:
        self.steps_left -= n
        if self.steps_left < 0:
            raise _TemplateLimit(f"more than {self.steps} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"more than {self.seconds:g} s")

    def size(self, n: int, what: str = "a value") -> None:
        if n > self.chars:
            raise _TemplateLimit(f"{what} of {n} characters, more than the {self.chars} allowed")

    def output(self, n: int) -> None:
        self.out += n
        self.size(self.out, "output")
        self.step()


_BUDGET: contextvars.ContextVar[RenderBudget | None] = contextvars.ContextVar("nemo_rz_chat_budget", default=None)


def _size(x, budget: RenderBudget) -> int:
    """About how many characters str(x) has (containers: their elements', shared ones counted every time they
    appear), stopping once past the budget's limit; the containers visited are charged as steps."""
    total, stack, visited = 0, [x], 0
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, (bytes, bytearray)):
            total += len(v) + 3
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, dict):
            total += 2 * len(v) + 2
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2 * len(v) + 2
            stack.extend(v)
        else:
            total += 24
        visited += 1
        if total > budget.chars:
            break
    budget.step(visited // 64)
    return total


_NUMBERS = re.compile(r"\d+")


def _check_format(fmt: str, args, budget: RenderBudget) -> None:
    """A format string's widths and precisions, and number arguments that can be widths ('%*s', '{:{w}}'), must
    stay within the budget, which is a crude bound on what a format can produce."""
    widths = sum(int(n) for n in _NUMBERS.findall(fmt) if len(n) < 20) + sum(
        abs(a) for a in args if isinstance(a, int) and not isinstance(a, bool) and ("*" in fmt or "{" in fmt))
    budget.size(len(fmt) + widths, "a formatted string")


def _check_replace(s: str, old, new, count, budget: RenderBudget) -> None:
    if isinstance(old, str) and isinstance(new, str):
        hits = s.count(old) if old else len(s) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        budget.size(len(s) + hits * max(0, len(new) - len(old)), "a replaced string")


def _check_method(obj, args, kwargs, budget: RenderBudget) -> None:
    """The str methods that can build a string much larger than their arguments: check what they would make."""
    fn = getattr(obj, "__wrapped__", obj)  # jinja wraps str.format at attribute access
    self, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if not isinstance(self, str):
        return
    ints = [a for a in (*args, *kwargs.values()) if isinstance(a, int) and not isinstance(a, bool)]
    if name in ("center", "ljust", "rjust", "zfill"):
        budget.size(max([len(self), *ints]), f"str.{name}'s result")
    elif name == "expandtabs":
        budget.size(len(self) + self.count("\t") * max([8, *ints]), "str.expandtabs's result")
    elif name in ("format", "format_map"):
        _check_format(self, [*args, *kwargs.values()], budget)
    elif name == "replace" and len(args) >= 2:
        _check_replace(self, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1), budget)
    elif name == "join" and args:
        budget.size(_size(args[0], budget) + len(self) * (len(args[0]) if hasattr(args[0], "__len__") else 0),
                    "str.join's result")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max([len(v) for v in args[0].values() if isinstance(v, str)] or [1])
        budget.size(len(self) * longest, "str.translate's result")


def _check_binop(op: str, left, right, budget: RenderBudget) -> None:
    seq = (str, list, tuple)
    if op == "*":
        for a, b in ((left, right), (right, left)):
            if isinstance(a, seq) and isinstance(b, int) and not isinstance(b, bool):
                budget.size((len(a) if isinstance(a, str) else _size(a, budget)) * max(b, 0), "a repeated value")
        if isinstance(left, int) and isinstance(right, int):
            budget.size((left.bit_length() + right.bit_length()) // 3, "a product")
    elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        budget.size(max(left.bit_length(), 1) * right // 3, "a power")
    elif op == "+" and isinstance(left, str) and isinstance(right, str):
        budget.size(len(left) + len(right), "a sum")
    elif op == "+" and isinstance(left, seq) and isinstance(right, seq):
        budget.size(_size(left, budget) + _size(right, budget), "a sum")
    elif op == "%" and isinstance(left, str):
        _check_format(left, right if isinstance(right, tuple) else [right], budget)


@functools.lru_cache(maxsize=1)
def _environment():
    """transformers' chat template environment (ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks,
    loop controls, the {% generation %} tag, tojson, raise_exception, strftime_now) with every loop iteration,
    call, operator, size-taking filter and output checked against the render's RenderBudget."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import _PassArg
    from jinja2.visitor import NodeTransformer

    def budget() -> RenderBudget:
        b = _BUDGET.get()
        if b is None:
            raise _TemplateLimit("rendered outside render_chat_template")
        return b

    def hook(name: str, node, *args):
        return nodes.Filter(node, name, list(args), [], None, None, lineno=node.lineno)

    class Bound(NodeTransformer):
        """Every loop's iterable counted item by item, every ~ concatenation's size checked, every output counted
        (literal text too, also inside macros and {% set %} blocks)."""

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = hook("_nemo_loop", node.iter)
            return node

        def visit_Concat(self, node):
            return hook("_nemo_sized", self.generic_visit(node))

        def visit_Output(self, node):
            node = self.generic_visit(node)
            text = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
            node.nodes = [c if isinstance(c, nodes.TemplateData) else hook("_nemo_out", c) for c in node.nodes]
            if text:
                node.nodes.insert(0, hook("_nemo_text", nodes.Const("", lineno=node.lineno), nodes.Const(text)))
            return node

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %}...{% endgeneration %} (it marks assistant tokens): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def _parse(self, source, name, filename):
            return Bound().visit(super()._parse(source, name, filename))

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right, budget())
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            b = budget()
            b.step()
            _check_method(__obj, args, kwargs, b)
            return super().call(__context, __obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.globals.pop("lipsum", None)  # lipsum(n) makes n paragraphs: no template needs it

    @jinja2.pass_context
    def loop(_, iterable):
        b = budget()
        for item in iterable:
            b.step()
            yield item

    @jinja2.pass_context
    def sized(_, value):
        budget().size(len(value), "a concatenated string")
        return value

    @jinja2.pass_context
    def out(_, value):
        text = str(value)
        budget().output(len(text))
        return text

    @jinja2.pass_context
    def text(_, value, n):
        budget().output(n)
        return value

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' tojson (no HTML escaping), encoded chunk by chunk so that an indent cannot make it explode
        b, parts, n = budget(), [], 0
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        for chunk in encoder.iterencode(x):
            n += len(chunk)
            b.size(n, "tojson's result")
            parts.append(chunk)
        b.step(len(parts) // 64)
        return "".join(parts)

    filters = env.filters

    def checked(name, check):
        original = filters[name]
        skip = 0 if _PassArg.from_obj(original) is None else 1  # the context / environment jinja passes first

        @functools.wraps(original)  # keeps jinja's pass_* mark
        def run(*args, **kwargs):
            check(budget(), *args[skip:], **kwargs)
            return original(*args, **kwargs)

        filters[name] = run

    def width(n):
        return len(n) if isinstance(n, str) else n if isinstance(n, int) and not isinstance(n, bool) else 0

    checked("center", lambda b, s, w=80: b.size(max(len(str(s)), width(w)), "center's result"))
    checked("indent", lambda b, s, w=4, *a, **k: b.size(len(str(s)) + (str(s).count("\n") + 1) * width(k.get("width", w)),
                                                        "indent's result"))
    checked("wordwrap", lambda b, s, w=79, brk=True, wrap=None, *a, **k: b.size(
        len(str(s)) * (1 + len(k.get("wrapstring", wrap) or "\n")), "wordwrap's result"))
    checked("batch", lambda b, v, n, fill=None: (b.size(width(n), "batch's line count"), b.step(width(n) // 64)))
    checked("slice", lambda b, v, n, fill=None: (b.size(width(n), "slice's count"), b.step(width(n) // 64)))
    checked("format", lambda b, fmt, *a, **k: _check_format(str(fmt), [*a, *k.values()], b))
    checked("replace", lambda b, s, old, new, count=None, *a: _check_replace(str(s), old, new, count, b))
    checked("join", lambda b, v, d="", attribute=None: b.size(_size(v, b) + len(str(d)) * (len(v) if hasattr(v, "__len__")
                                                                                          else 0), "join's result"))
    filters.update(_nemo_loop=loop, _nemo_sized=sized, _nemo_out=out, _nemo_text=text, tojson=tojson)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    return _environment().from_string(template)


# A render may take this much (the character and step bounds grow with the size of the messages).
RENDER_STEPS = 1_000_000
RENDER_CHARS = 1 << 20
RENDER_SECONDS = 10.0
PER_INPUT_CHAR = 16


def render_chat_template(template: str, seconds: float | None = None, **variables) -> str:
    """`template` rendered with `variables` as transformers' apply_chat_template renders it, within bounds: at
    most RENDER_STEPS loop iterations and calls, RENDER_CHARS characters in any value built and in the output
    together (each plus PER_INPUT_CHAR per character of the variables), and RENDER_SECONDS seconds. Raises
    _TemplateLimit past a bound, jinja2's errors for a broken template."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    probe = RenderBudget(1 << 62, 1 << 62, 1e9)
    extra = PER_INPUT_CHAR * _size(variables, probe)
    compiled = _compiled(template)
    token = _BUDGET.set(RenderBudget(RENDER_STEPS + extra, RENDER_CHARS + extra, seconds))
    try:
        return compiled.render(**variables)
    finally:
        _BUDGET.reset(token)


class HFTokenizer:
    """A transformers tokenizer with explicit eos_ids and BOS policy (see the module docstring)."""

    def __init__(self, tokenizer, add_bos: bool | None = None, eos_ids=(), name: str = "tokenizer"):
        self.tok, self.name = tokenizer, name
        self.vocab_size = len(tokenizer)
        self.bos_id = tokenizer.bos_token_id
        eos = _ids(tokenizer.eos_token_id) + _ids(list(eos_ids))
        if not eos:
            raise ValueError(f"{name} defines no EOS token: generation could never stop; use a tokenizer with an "
                             "eos_token (tokenizer_config.json) or eos_token_id in generation_config.json")
        self.eos_ids = tuple(dict.fromkeys(eos))
        self.eos_id = self.eos_ids[0]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        if add_bos is None:  # what the tokenizer does by itself
            add_bos = self.bos_id is not None and tokenizer("a")["input_ids"][:1] == [self.bos_id]
        if add_bos and self.bos_id is None:
            raise ValueError(f"{name} asks for a BOS token (add_bos_token) but defines none; fix tokenizer_config.json")
        self.add_bos = bool(add_bos)
        self.chat_template = tokenizer.chat_template
        unk = tokenizer.unk_token_id
        self._unk = (unk, tokenizer.unk_token) if unk is not None else None

    @classmethod
    def from_pretrained(cls, path) -> "HFTokenizer":
        """The tokenizer of a checkpoint directory or a .gguf file."""
        path = Path(path)
        if not path.exists():
            raise ValueError(f"tokenizer path {path} does not exist; pass a checkpoint directory or a .gguf file")
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ValueError(f"tokenizer path {path} is a file but not a .gguf file; pass a checkpoint directory "
                                 "(with tokenizer.json) or a .gguf file")
            return cls._from_gguf(path)
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {path}; save the tokenizer there "
                             "(tokenizer.save_pretrained) or set model.tokenizer=char for the character tokenizer")
        require(HF_TOKENIZER, f"the tokenizer in {path}", "hf")
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"cannot load the tokenizer in {path}: {' '.join(str(e).split())[:300]}") from None
        declared = _read_json(path / "tokenizer_config.json").get("add_bos_token") \
            if (path / "tokenizer_config.json").is_file() else None
        gen = path / "generation_config.json"
        eos = _ids(_read_json(gen).get("eos_token_id")) if gen.is_file() else []
        return cls(tok, declared if isinstance(declared, bool) else None, eos, name=f"the tokenizer in {path}")

    @classmethod
    def _from_gguf(cls, path: Path) -> "HFTokenizer":
        require(GGUF, f"the tokenizer in {path}", "hf")
        from transformers import AutoTokenizer

        from nemo_rz.models.gguf import metadata

        meta = metadata(path, ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.eos_token_id"))
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:  # transformers' GGUF reader and config validators raise many kinds
            raise ValueError(f"cannot load the tokenizer of {path}: {' '.join(str(e).split())[:300]}") from None
        return cls(tok, meta.get("tokenizer.ggml.add_bos_token"), _ids(meta.get("tokenizer.ggml.eos_token_id")),
                   name=f"the tokenizer of {path}")

    # -- the task tokenizer interface --------------------------------------------------------------
    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._checked(self.tok(text, add_special_tokens=False)["input_ids"], text)
        if bos:
            if self.bos_id is None:
                raise ValueError(f"{self.name} has no BOS token to add")
            ids = [self.bos_id] + ids
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        for pos, i in enumerate(ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} at position {pos} is outside the vocabulary [0, {self.vocab_size}) of "
                                 f"{self.name}; the model and tokenizer disagree on vocab size")
        if stop_at_eos:
            ends = [pos for pos, i in enumerate(ids) if i in self.eos_ids]
            ids = ids[: ends[0]] if ends else ids
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """ids of `messages` under the chat template (rendered, then tokenized without special tokens, as
        apply_chat_template(tokenize=True) does), with BOS in front when the policy wants it and the template
        did not write it."""
        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template; set task.chat_template=false for plain prompts")
        try:
            text = self._render(messages, add_generation_prompt)
        except _TemplateLimit as e:
            raise ValueError(f"the chat template of {self.name} went past its render bound ({e}): it loops or grows "
                             "without end; fix the chat template (tokenizer_config.json or chat_template.jinja) or use "
                             "task.chat_template=false") from None
        except Exception as e:  # jinja2 errors, raise_exception() inside templates (e.g. roles must alternate)
            raise ValueError(f"the chat template of {self.name} refused the messages: "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        ids = self._checked(self.tok(text, add_special_tokens=False)["input_ids"], text)
        return [self.bos_id] + ids if self.add_bos and ids[:1] != [self.bos_id] else ids

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """The template's text for `messages`, as apply_chat_template(tokenize=False) makes it (the same template
        choice and variables: the special tokens, tools=None, documents=None), rendered within bounds."""
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        get = getattr(self.tok, "get_chat_template", None)
        template = get(None, None) if get is not None else self.chat_template
        variables = {**self.tok.special_tokens_map, "messages": messages, "tools": None, "documents": None,
                     "add_generation_prompt": add_generation_prompt}
        return render_chat_template(template, **variables)

    def _checked(self, ids: list[int], text: str) -> list[int]:
        """ids, refusing text that came out as the unknown token (a word-level vocabulary without a byte fallback)."""
        if self._unk is not None and ids.count(self._unk[0]) > text.count(self._unk[1]):
            shown = repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"
            raise ValueError(f"{self.name} cannot encode {shown}: part of it maps to the unknown token {self._unk[1]!r}")
        return ids

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.name}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, add_bos={self.add_bos}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")
