"""Synthetic verifiable tasks: addition, multiplication, reversal of digit strings.

  add{d}     "a+b="     -> str(a + b)     a, b in [0, 10^d)              (add1: 100 problems, add3: 10^6)
  mul{d}     "a*b="     -> str(a * b)     a in [0, 10^d), b in [0, 10)
  reverse    "rev s="   -> s reversed     s a digit string of min_len..max_len digits, leading zeros kept
                                          (answer length follows the input, not the value)
Each problem is an index into the task's space; train and held-out are disjoint index draws from
`seed` (base.split_indices), so the same seed always gives the same splits.
Reward: 1.0 when the completion's text up to EOS equals the answer exactly, else 0.0.

With a chat tokenizer (task.chat_template auto/true), prompts are word problems ("What is 12 + 34? Answer with
just the number.") rendered by the chat template, and the reward reads the last number of the reply.
"""
from __future__ import annotations

from typing import Callable

from nemo_rz.tasks import verifiers
from nemo_rz.tasks.base import Problem, Task, split_indices, use_chat
from nemo_rz.tasks.options import Range, checked_by, limits
from nemo_rz.tasks.tokenizer import CharTokenizer, Tokenizer

MAX_PROBLEMS = 1_000_000  # n_train, n_heldout: every problem is built and held in memory
MAX_DIGITS = 512  # reverse: digits per string (a 512-digit prompt is already ~520 tokens; each problem is built in memory)
_SPLITS = dict(
    seed=Range(0),
    n_train=Range(1, MAX_PROBLEMS, null_means="for min(50000, what is not held out)",
                  why="every problem is built and held in memory"),
    n_heldout=Range(1, MAX_PROBLEMS, null_means="for min(500, a fifth of the problems)",
                    why="eval measures pass@1 on the held-out problems, so hold out at least 1"),
)


def exact_match(text: str, answer: str) -> float:
    """1.0 iff the text is the answer, character for character (no stripping: format is part of the task)."""
    return 1.0 if text == answer else 0.0


# Each task: (size of its problem space, problem(index, chat) -> Problem, the verifier for chat phrasing).
# Chat models answer in words ("17 + 25 = 42"), so their verifier reads the last number (digits: the last
# digit string, leading zeros kept) instead of requiring the bare answer.
Space = tuple[int, Callable[[int, bool], Problem], Callable[[str, str], float]]


def _addition(digits: int) -> Space:
    n = 10 ** digits

    def problem(i: int, chat: bool) -> Problem:
        a, b = divmod(i, n)
        prompt = f"What is {a} + {b}? Answer with just the number." if chat else f"{a}+{b}="
        return Problem(prompt, str(a + b))
    return n * n, problem, verifiers.numeric


def _multiplication(digits: int) -> Space:
    n = 10 ** digits

    def problem(i: int, chat: bool) -> Problem:
        a, b = divmod(i, 10)
        prompt = f"What is {a} times {b}? Answer with just the number." if chat else f"{a}*{b}="
        return Problem(prompt, str(a * b))
    return n * 10, problem, verifiers.numeric


def _check_lengths(options: dict) -> None:
    min_len, max_len = options.get("min_len", 3), options.get("max_len", 5)
    if not 1 <= min_len <= max_len:
        raise ValueError(f"reverse task: task.options.min_len = {min_len} is more than task.options.max_len = {max_len}; "
                         "need 1 <= min_len <= max_len")


def _reverse(min_len: int, max_len: int) -> Space:
    _check_lengths({"min_len": min_len, "max_len": max_len})
    sizes = [10 ** L for L in range(min_len, max_len + 1)]

    def problem(i: int, chat: bool) -> Problem:
        for L, size in zip(range(min_len, max_len + 1), sizes):   # index -> (length, value): injective
            if i < size:
                s = str(i).zfill(L)
                prompt = f"Write the digits {s} in reverse order. Answer with just the digits." if chat else f"rev {s}="
                return Problem(prompt, s[::-1])
            i -= size
        raise IndexError(i)
    return sum(sizes), problem, verifiers.digits


def _make(name: str, space: Space, seed: int, n_train, n_heldout, tokenizer, chat_template, system_prompt) -> Task:
    size, problem, chat_verifier = space
    tokenizer = tokenizer or CharTokenizer()
    chat = use_chat(tokenizer, chat_template)
    train_idx, held_idx = split_indices(size, n_train, n_heldout, seed, f"task {name}")
    return Task(name, [problem(i, chat) for i in train_idx], [problem(i, chat) for i in held_idx], tokenizer,
                chat_verifier if chat else exact_match, chat=chat, system_prompt=system_prompt)


@limits(**_SPLITS)
def addition(digits: int = 2, seed: int = 0, n_train: int | None = None, n_heldout: int | None = None,
             tokenizer: Tokenizer | None = None, chat_template="auto", system_prompt: str | None = None) -> Task:
    """d-digit addition ("12+34=" -> "46")."""
    if digits < 1:
        raise ValueError(f"addition task: digits must be >= 1, got {digits}")
    return _make(f"add{digits}", _addition(digits), seed, n_train, n_heldout, tokenizer, chat_template, system_prompt)


@limits(**_SPLITS)
def multiplication(digits: int = 1, seed: int = 0, n_train: int | None = None, n_heldout: int | None = None,
                   tokenizer: Tokenizer | None = None, chat_template="auto", system_prompt: str | None = None) -> Task:
    """d-digit times 1-digit multiplication ("12*3=" -> "36")."""
    if digits < 1:
        raise ValueError(f"multiplication task: digits must be >= 1, got {digits}")
    return _make(f"mul{digits}", _multiplication(digits), seed, n_train, n_heldout, tokenizer, chat_template,
                 system_prompt)


@limits(**_SPLITS, min_len=Range(1, MAX_DIGITS), max_len=Range(1, MAX_DIGITS, why="digits per string: "
                                                                   "every problem is built in memory, and a prompt this long "
                                                                   "already needs a model of 520 positions"))
@checked_by(_check_lengths)
def reverse(min_len: int = 3, max_len: int = 5, seed: int = 0, n_train: int | None = None,
            n_heldout: int | None = None, tokenizer: Tokenizer | None = None, chat_template="auto",
            system_prompt: str | None = None) -> Task:
    """Reverse a digit string ("rev 120=" -> "021")."""
    return _make("reverse", _reverse(min_len, max_len), seed, n_train, n_heldout, tokenizer, chat_template,
                 system_prompt)
