"""The tokenizer interface tasks use, and a character tokenizer with a fixed vocabulary (ids never depend on data).

Every tokenizer (CharTokenizer here, HFTokenizer in hf_tokenizer.py) provides:
  encode(text, bos=False, eos=False) -> ids      plain text; bos / eos add those special tokens
  decode(ids, stop_at_eos=True) -> str          stops at the first of eos_ids
  chat(messages, add_generation_prompt=True)    ids of [{"role", "content"}, ...] under the chat template
  vocab_size, pad_id, bos_id, eos_id            eos_id ends a target answer (supervised warm-up)
  eos_ids                                       every id that ends a generation
  add_bos                                       the BOS policy: does a sequence start with bos_id?
  chat_template                                 the template text, or None (then chat() raises)

CharTokenizer ids: 0 = PAD, 1 = BOS, 2 = EOS, then one id per character of `chars` in order.
The default alphabet covers the built-in tasks: digits, "+-*=", ":", space and lowercase letters.
"""
from __future__ import annotations

from typing import Protocol, Sequence

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)
DEFAULT_CHARS = "0123456789+-*=: abcdefghijklmnopqrstuvwxyz"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    eos_ids: tuple[int, ...]
    add_bos: bool
    chat_template: str | None

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], stop_at_eos: bool = True) -> str: ...

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


class CharTokenizer:
    """encode(str) -> ids, decode(ids) -> str; one id per character."""

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            dup = next(c for i, c in enumerate(chars) if c in chars[:i])
            raise ValueError(f"CharTokenizer: character {dup!r} appears twice in the alphabet; list each once")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.eos_ids, self.add_bos, self.chat_template = (self.eos_id,), True, None
        self._id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self.vocab_size = len(SPECIALS) + len(chars)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """One id per character; bos/eos add the special tokens around it."""
        ids = []
        for pos, c in enumerate(text):
            i = self._id.get(c)
            if i is None:
                shown = repr(text) if len(text) <= 60 else repr(text[:60]) + f"... ({len(text)} characters)"
                raise ValueError(f"CharTokenizer: unknown character {c!r} at position {pos} of {shown}; "
                                 "add it to the tokenizer's chars")
            ids.append(i)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids, stop_at_eos: bool = True) -> str:
        """Characters of ids; PAD and BOS are skipped; stops at the first EOS unless stop_at_eos=False."""
        out = []
        for pos, i in enumerate(ids):
            i = int(i)
            if i == self.eos_id:
                if stop_at_eos:
                    break
                continue
            if i in (self.pad_id, self.bos_id):
                continue
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer: token id {i} at position {pos} is outside the vocabulary "
                                 f"[0, {self.vocab_size}); the model and tokenizer disagree on vocab size")
            out.append(self.chars[i - len(SPECIALS)])
        return "".join(out)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        raise ValueError("the character tokenizer has no chat template: use a model's tokenizer (model.hf_path or "
                         "model.tokenizer) for chat prompts, or task.chat_template=false")

    def __repr__(self) -> str:
        return f"CharTokenizer(chars={self.chars!r})"
