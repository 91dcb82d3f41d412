"""Procedural addition, the demo task: ``"37+48="`` → ``"58"`` (answer written least-significant digit
first by default, ``"85"`` in normal order). Operands are zero-padded to a fixed width (``"07+48="``) so
each digit sits at a fixed position.

Writing the sum in reverse lets a tiny left-to-right model produce each digit with its carry already
known; measured here, GRPO learns that order and plateaus near 0.5 with the normal one (DESIGN §11).
Task id = a · 10^d + b for d-digit operands; about 10% of ids, chosen by hash, are held out for eval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property

from prime_node.tasks.base import unknown_task

EVAL_PERCENT = 10


def _held_out(task_id: int) -> bool:
    digest = hashlib.sha256(b"prime-node/arithmetic/split/" + task_id.to_bytes(8, "big")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < EVAL_PERCENT


class ArithmeticTask:
    """Addition of two ``digits``-digit numbers (0 to 10^digits - 1)."""

    def __init__(self, digits: int = 2, reverse_answer: bool = True) -> None:
        if not 1 <= digits <= 6:
            raise ValueError("digits must lie in [1, 6]")
        self.digits = digits
        self.reverse_answer = reverse_answer
        self.base: int = 10**digits
        self.name = f"arithmetic-{digits}d{'-lsd' if reverse_answer else ''}"

    @cached_property
    def _split(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        ids = range(self.base * self.base)
        return tuple(i for i in ids if not _held_out(i)), tuple(i for i in ids if _held_out(i))

    def train_ids(self) -> Sequence[int]:
        return self._split[0]

    def eval_ids(self) -> Sequence[int]:
        return self._split[1]

    def operands(self, task_id: int) -> tuple[int, int]:
        if not 0 <= task_id < self.base * self.base:
            raise unknown_task(self.name, task_id)
        return divmod(task_id, self.base)

    def prompt(self, task_id: int) -> str:
        a, b = self.operands(task_id)
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    def answer(self, task_id: int) -> str:
        a, b = self.operands(task_id)
        text = str(a + b)
        return text[::-1] if self.reverse_answer else text

    def score(self, task_id: int, completion: str) -> float:
        return 1.0 if completion.strip() == self.answer(task_id) else 0.0
