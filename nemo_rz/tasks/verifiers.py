"""Verifiers: verifier(text, answer) -> reward in [0, 1], text = the completion decoded up to EOS.

  exact    1.0 iff text.strip() == answer.strip()
  numeric  1.0 iff the last number in the text equals the answer (commas between digit groups dropped;
           |x - y| <= max(rel_tol * max(|x|, |y|), abs_tol)); "17 + 25 = 42" answers 42
  digits   1.0 iff the last run of digits in the text is the answer, character for character (leading zeros count)
  boxed    the content of the last \\boxed{...} (braces balanced), compared as `exact`, or as numbers when both are
  math     the `math-verify` package (optional: pip install "nemo-rz[math]") decides whether the text and the
           answer are the same mathematical object (LaTeX, fractions, sets, intervals...)
A model's output is never an error (no number, an unclosed \\boxed{ ...: reward 0); an answer that cannot be
checked (e.g. not a number for `numeric`) raises ValueError whatever the text, so check_answer() asks the
verifier itself with an empty text. Verifiers are registered by name (nemo_rz.plugins, entry points
verifier.<name>): another package adds one the same way.
"""
from __future__ import annotations

import math
import re

from nemo_rz import plugins
from nemo_rz.extras import MATH_VERIFY, require

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
_DIGITS = re.compile(r"\d+")


def exact(text: str, answer: str) -> float:
    return 1.0 if text.strip() == answer.strip() else 0.0


def _number(s: str) -> float | None:
    try:
        x = float(s.strip().replace(",", ""))
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def last_number(text: str) -> float | None:
    """The value of the last number written in text (None when there is none)."""
    found = _NUMBER.findall(text)
    return _number(found[-1]) if found else None


def _answer_number(answer: str, verifier: str) -> float:
    y = _number(answer)
    if y is None:
        raise ValueError(f"{verifier} verifier: answer {answer!r} is not a number; use the exact verifier")
    return y


def numeric(text: str, answer: str, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    y = _answer_number(answer, "numeric")
    x = last_number(text)
    return 1.0 if x is not None and math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def digits(text: str, answer: str) -> float:
    if not answer.strip().isdigit():
        raise ValueError(f"digits verifier: answer {answer!r} is not a digit string; use the exact verifier")
    found = _DIGITS.findall(text)
    return 1.0 if found and found[-1] == answer.strip() else 0.0


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} with balanced braces, or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[i + 1: j]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: an earlier, closed one may still count
    return None


def boxed(text: str, answer: str) -> float:
    content = last_boxed(text)
    if content is None:
        return 0.0
    x, y = _number(content), _number(answer)
    if x is not None and y is not None:
        return 1.0 if math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return exact(content, answer)


def math_equal(text: str, answer: str) -> float:
    require(MATH_VERIFY, "the math verifier", "math")
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    if not gold:
        raise ValueError(f"math verifier: cannot parse the answer {answer!r}")
    return 1.0 if verify(gold, parse(text)) else 0.0


VERIFIERS = plugins.Registry("verifier")  # every registered verifier: the built-ins above, then plugins'


def check_answer(verifier: str, answer: str) -> None:
    """Raise ValueError when `verifier` cannot check `answer` at all (e.g. not a number for numeric)."""
    plugins.load("verifier", verifier)("", answer)
