"""A character tokenizer with a fixed vocabulary, so token ids never depend on the data seen.

ids: 0 = PAD, 1 = BOS, 2 = EOS, then one id per character of `chars` in order.
The default alphabet covers the built-in tasks: digits, "+-*=", ":", space and lowercase letters.
"""
from __future__ import annotations

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIALS = (PAD, BOS, EOS)
DEFAULT_CHARS = "0123456789+-*=: abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """encode(str) -> ids, decode(ids) -> str; one id per character."""

    def __init__(self, chars: str = DEFAULT_CHARS):
        if len(set(chars)) != len(chars):
            dup = next(c for i, c in enumerate(chars) if c in chars[:i])
            raise ValueError(f"CharTokenizer: character {dup!r} appears twice in the alphabet; list each once")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self._id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self.vocab_size = len(SPECIALS) + len(chars)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """One id per character; bos/eos add the special tokens around it."""
        ids = []
        for pos, c in enumerate(text):
            i = self._id.get(c)
            if i is None:
                raise ValueError(f"CharTokenizer: unknown character {c!r} at position {pos} of {text!r}; "
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

    def __repr__(self) -> str:
        return f"CharTokenizer(chars={self.chars!r})"
