"""A Hugging Face tokenizer behind the task tokenizer interface (tokenizer.py): the checkpoint's own ids and chat template.

HFTokenizer.from_pretrained takes a checkpoint directory (tokenizer files, optional generation_config.json) or a
.gguf file (tokenizer and template are in its metadata). What transformers leaves implicit is made explicit here:
  - eos_ids: the tokenizer's EOS plus every eos_token_id of generation_config.json (or the GGUF metadata), so
    generation stops where the model's own generate() would (e.g. <|im_end|> for chat models);
  - add_bos (the BOS policy): the checkpoint's declared add_bos_token (tokenizer_config.json, or GGUF
    tokenizer.ggml.add_bos_token), else whatever the tokenizer does on its own. transformers' GGUF tokenizer
    never adds BOS, although some GGUF models produce garbage without it;
  - chat() returns ids (transformers 5's apply_chat_template(tokenize=True) returns a mapping, 4.x a list).
"""
from __future__ import annotations

import json
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
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2 errors, raise_exception() inside templates (e.g. roles must alternate)
            raise ValueError(f"the chat template of {self.name} refused the messages: "
                             f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from None
        ids = self._checked(self.tok(text, add_special_tokens=False)["input_ids"], text)
        return [self.bos_id] + ids if self.add_bos and ids[:1] != [self.bos_id] else ids

    def _checked(self, ids: list[int], text: str) -> list[int]:
        """ids, refusing text that came out as the unknown token (a word-level vocabulary without a byte fallback)."""
        if self._unk is not None and ids.count(self._unk[0]) > text.count(self._unk[1]):
            shown = repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"
            raise ValueError(f"{self.name} cannot encode {shown}: part of it maps to the unknown token {self._unk[1]!r}")
        return ids

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.name}, vocab_size={self.vocab_size}, eos_ids={self.eos_ids}, add_bos={self.add_bos}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")
