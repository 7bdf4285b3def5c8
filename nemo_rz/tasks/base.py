"""Problem and Task: what every verifiable-reward task provides to the rollout and the learner.

A completion is the list of token ids generated after the prompt. Its text is the decoding up to the
first EOS; without an EOS (the generation ran out of budget) it earns 0 when require_eos is set.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from nemo_rz.tasks.tokenizer import CharTokenizer


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


def split_indices(space: int, n_train: int | None, n_heldout: int | None, seed: int,
                  where: str) -> tuple[list[int], list[int]]:
    """Distinct indices into a problem space of `space` items, drawn from `seed`: (train, heldout).

    Drawn without replacement, so the two lists never share an index. Defaults: held out
    min(500, space // 5), train min(50_000, the rest).
    """
    if n_heldout is None:
        n_heldout = min(500, space // 5)
    if n_train is None:
        n_train = min(50_000, space - n_heldout)
    if n_train < 1 or n_heldout < 0 or n_train + n_heldout > space:
        raise ValueError(f"{where}: cannot draw n_train={n_train} and n_heldout={n_heldout} distinct problems "
                         f"from {space}; lower them (n_train >= 1, sum <= {space})")
    idx = random.Random(seed).sample(range(space), n_heldout + n_train)
    return idx[n_heldout:], idx[:n_heldout]


class Task:
    """Problems split into train / heldout, a tokenizer, and a verifier(text, answer) -> reward."""

    def __init__(self, name: str, train: list[Problem], heldout: list[Problem], tokenizer: CharTokenizer,
                 verifier: Callable[[str, str], float], require_eos: bool = True):
        self.name, self.train, self.heldout = name, list(train), list(heldout)
        self.tokenizer, self.verifier, self.require_eos = tokenizer, verifier, require_eos

    def split(self, name: str) -> list[Problem]:
        if name not in ("train", "heldout"):
            raise ValueError(f"task {self.name}: unknown split {name!r}: use train or heldout")
        return self.train if name == "train" else self.heldout

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """n training problems drawn with replacement from rng (the caller owns the RNG state)."""
        return rng.choices(self.train, k=n)

    def encode_prompt(self, prompt: str) -> list[int]:
        """BOS + the prompt's characters: what the engine is given."""
        return self.tokenizer.encode(prompt, bos=True)

    def encode_answer(self, answer: str) -> list[int]:
        """The answer's characters + EOS: the target completion (supervised warm-up)."""
        return self.tokenizer.encode(answer, eos=True)

    def completion_text(self, completion) -> str | None:
        """Text of a completion up to its first EOS; None when it has no EOS and require_eos is set."""
        if isinstance(completion, str):
            return completion
        ids = [int(i) for i in completion]
        if self.require_eos and self.tokenizer.eos_id not in ids:
            return None
        return self.tokenizer.decode(ids, stop_at_eos=True)

    def reward(self, completion, answer: str) -> float:
        """verifier(completion text, answer), 0.0 for a completion without EOS (when required)."""
        text = self.completion_text(completion)
        return 0.0 if text is None else float(self.verifier(text, answer))

    def __repr__(self) -> str:
        return f"Task({self.name!r}, train={len(self.train)}, heldout={len(self.heldout)})"
