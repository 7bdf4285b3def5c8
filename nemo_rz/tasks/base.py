"""Problem and Task: what every verifiable-reward task provides to the rollout and the learner.

A problem's prompt is text, or chat messages ((role, content), ...). A task renders prompts one of two ways:
plain (the tokenizer's BOS policy + the text) or chat (the tokenizer's chat template with a generation prompt,
task.system_prompt first when given). A completion is the list of token ids generated after the prompt. Its
text is the decoding up to the first of the tokenizer's eos_ids; without one (the generation ran out of
budget) it earns 0 when require_eos is set.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Union

from nemo_rz.tasks.tokenizer import Tokenizer

Messages = tuple[tuple[str, str], ...]  # ((role, content), ...): hashable, so problems can be compared and counted


@dataclasses.dataclass(frozen=True)
class Problem:
    prompt: Union[str, Messages]
    answer: str
    where: str = dataclasses.field(default="", compare=False)  # e.g. "data.jsonl:12", named in errors


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
    if n_heldout < 1:
        raise ValueError(f"{where}: n_heldout = {n_heldout}: hold out at least 1 problem (eval measures pass@1 on the "
                         "held-out problems)")
    if n_train < 1 or n_train + n_heldout > space:
        raise ValueError(f"{where}: cannot draw n_train={n_train} and n_heldout={n_heldout} distinct problems "
                         f"from {space}; lower them (n_train >= 1, sum <= {space})")
    idx = random.Random(seed).sample(range(space), n_heldout + n_train)
    return idx[n_heldout:], idx[:n_heldout]


def use_chat(tokenizer: Tokenizer, chat_template) -> bool:
    """task.chat_template: auto (chat when the tokenizer has a template) | true | false."""
    setting = str(chat_template).lower()
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"task.chat_template = {chat_template!r}: use auto, true or false")
    if setting == "true" and tokenizer.chat_template is None:
        raise ValueError("task.chat_template=true but the tokenizer has no chat template; use a chat model's "
                         "tokenizer (model.hf_path / model.tokenizer) or task.chat_template=auto")
    return setting == "true" or (setting == "auto" and tokenizer.chat_template is not None)


class Task:
    """Problems split into train / heldout, a tokenizer, a verifier(text, answer) -> reward, and how prompts
    are rendered (chat: through the tokenizer's chat template, with system_prompt first when given)."""

    def __init__(self, name: str, train: list[Problem], heldout: list[Problem], tokenizer: Tokenizer,
                 verifier: Callable[[str, str], float], require_eos: bool = True, chat: bool = False,
                 system_prompt: str | None = None):
        if system_prompt is not None and not chat:
            raise ValueError(f"task {name}: task.system_prompt needs chat prompts, but they are off (no chat template, "
                             "or task.chat_template=false); drop the system prompt or use a chat model's tokenizer")
        self.name, self.train, self.heldout = name, list(train), list(heldout)
        self.tokenizer, self.verifier, self.require_eos = tokenizer, verifier, require_eos
        self.chat, self.system_prompt = chat, system_prompt

    def split(self, name: str) -> list[Problem]:
        if name not in ("train", "heldout"):
            raise ValueError(f"task {self.name}: unknown split {name!r}: use train or heldout")
        return self.train if name == "train" else self.heldout

    def sample(self, n: int, rng: random.Random) -> list[Problem]:
        """n training problems drawn with replacement from rng (the caller owns the RNG state)."""
        return rng.choices(self.train, k=n)

    def encode_prompt(self, prompt: str | Messages) -> list[int]:
        """What the engine is given: chat-rendered messages, or BOS (per the tokenizer's policy) + the text."""
        tok = self.tokenizer
        if self.chat:
            turns = (("user", prompt),) if isinstance(prompt, str) else prompt
            if self.system_prompt is not None and turns[0][0] != "system":
                turns = (("system", self.system_prompt),) + tuple(turns)
            return tok.chat([{"role": r, "content": c} for r, c in turns], add_generation_prompt=True)
        if not isinstance(prompt, str):
            raise ValueError("a chat-messages prompt needs chat rendering, which is off (no chat template, or "
                             "task.chat_template=false)")
        return tok.encode(prompt, bos=tok.add_bos)

    def encode_answer(self, answer: str) -> list[int]:
        """The answer's tokens + EOS: the target completion (supervised warm-up)."""
        return self.tokenizer.encode(answer, eos=True)

    def validate(self, max_prompt_tokens: int | None = None) -> int:
        """Encode every prompt once; raise ValueError naming the problem (file:line for data) when one cannot
        be encoded or is longer than max_prompt_tokens (None: no limit). Returns the longest prompt's length."""
        longest = 0
        for split in (self.train, self.heldout):
            for p in split:
                where = p.where or f"task {self.name}, prompt {str(p.prompt)[:60]!r}"
                try:
                    n = len(self.encode_prompt(p.prompt))
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
                if max_prompt_tokens is not None and n > max_prompt_tokens:
                    raise ValueError(f"{where}: the prompt is {n} tokens, over the {max_prompt_tokens} that fit (the "
                                     "model's max_position_embeddings minus algo.max_new_tokens); shorten or drop it")
                longest = max(longest, n)
        return longest

    def completion_text(self, completion) -> str | None:
        """Text of a completion up to its first EOS; None when it has no EOS and require_eos is set."""
        if isinstance(completion, str):
            return completion
        ids = [int(i) for i in completion]
        if self.require_eos and not set(self.tokenizer.eos_ids) & set(ids):
            return None
        return self.tokenizer.decode(ids, stop_at_eos=True)

    def reward(self, completion, answer: str) -> float:
        """verifier(completion text, answer), 0.0 for a completion without EOS (when required)."""
        text = self.completion_text(completion)
        return 0.0 if text is None else float(self.verifier(text, answer))

    def __repr__(self) -> str:
        return f"Task({self.name!r}, train={len(self.train)}, heldout={len(self.heldout)}, chat={self.chat})"
