"""Exact-answer math from a local file: the reward is 1 when the last ``\\boxed{...}`` of the completion
equals the reference answer after normalisation.

Records: ``{"question" | "problem" | "prompt": str, "answer" | "solution": str}`` (a reference given as a
full solution is reduced to its last boxed answer). Normalisation strips spacing, ``$``, ``\\left``/
``\\right``, ``\\!``, ``\\text{...}`` wrappers, ``^\\circ``, a trailing period and thousands separators,
turns ``\\dfrac``/``\\tfrac`` into ``\\frac``; two answers that both parse as rational numbers (integers,
decimals, ``a/b``, ``\\frac{a}{b}``) are compared by value. Ids are record positions; every 10th is held
out for evaluation.

With ``chat`` (a run's ``task.chat = true``) each question is posed as a user turn through the model's
chat template, followed by ``BOXED_INSTRUCTION``; scoring is the same.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

from prime_node.tasks.base import ListedProblems
from prime_node.tasks.chat import ChatPrompt
from prime_node.tasks.records import read_records, require_text

_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_FRAC = re.compile(r"^\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SIMPLE_FRAC = re.compile(r"^(-?\d+)/(-?\d+)$")
_NUMBER = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
MAX_ANSWER_CHARS = 1000
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``) with balanced braces, else None."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, min(len(text), i + MAX_ANSWER_CHARS)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def normalize_answer(answer: str) -> str:
    text = answer.strip()
    text = _TEXT.sub(r"\1", text)
    for old, new in (
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("$", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\%", ""),
        ("%", ""),
    ):
        text = text.replace(old, new)
    text = _THOUSANDS.sub("", text)
    text = "".join(text.split())
    return text.rstrip(".")


def _as_number(text: str) -> Fraction | None:
    if match := _FRAC.match(text) or _SIMPLE_FRAC.match(text):
        numerator, denominator = int(match.group(1)), int(match.group(2))
        return Fraction(numerator, denominator) if denominator != 0 else None
    if _NUMBER.match(text) and len(text) <= 64:
        return Fraction(text)
    return None


def answers_match(given: str, reference: str) -> bool:
    a, b = normalize_answer(given), normalize_answer(reference)
    if a == b:
        return bool(a)
    x, y = _as_number(a), _as_number(b)
    return x is not None and x == y


class MathTask(ListedProblems):
    def __init__(
        self, problems: Sequence[tuple[str, str]], name: str = "math", *, chat: bool = False
    ) -> None:
        super().__init__(problems, name=name, kind="math")
        self.chat = chat

    def prompt(self, task_id: int) -> str:
        question = self._get(task_id)[0]
        return ChatPrompt(f"{question}\n{BOXED_INSTRUCTION}") if self.chat else question

    @classmethod
    def from_file(cls, path: Path, *, chat: bool = False) -> MathTask:
        problems = []
        for number, record in enumerate(read_records(path), start=1):
            where = f"{path} record {number}"
            question = require_text(record, ("question", "problem", "prompt"), where)
            answer = require_text(record, ("answer", "solution"), where)
            problems.append((question, last_boxed(answer) or answer))
        return cls(problems, name=f"math:{path.name}", chat=chat)

    def answer(self, task_id: int) -> str:
        return self._get(task_id)[1]

    def record(self, task_id: int) -> dict[str, str]:
        """The task as a record of this class's file format (the filter writes these)."""
        question, answer = self._get(task_id)
        return {"question": question, "answer": answer}

    def score(self, task_id: int, completion: str) -> float:
        boxed = last_boxed(completion)
        return 1.0 if boxed is not None and answers_match(boxed, self.answer(task_id)) else 0.0
