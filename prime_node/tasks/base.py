"""The task interface shared by every task source, and the length-shaped reward built on it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prime_node.errors import NodeError


class TaskSource(Protocol):
    """A pool of verifiable tasks addressed by integer ids.

    ``train_ids`` is the ordered pool the schedule draws from (protocol/schedule.py picks indices into
    it); ``eval_ids`` is held out. ``score`` must be deterministic, must never raise on any completion
    text (a hostile or broken completion is worth 0.0) and returns a value in [0, 1].
    """

    name: str

    def train_ids(self) -> Sequence[int]: ...

    def eval_ids(self) -> Sequence[int]: ...

    def prompt(self, task_id: int) -> str: ...

    def score(self, task_id: int, completion: str) -> float: ...


def unknown_task(source: str, task_id: int) -> NodeError:
    return NodeError(f"task {task_id} does not exist in {source}", reason="unknown_task")


def length_bonus(completion_tokens: int, *, target: int, coef: float) -> float:
    """``coef * max(0, 1 - |n - target| / target)``: a reward that peaks at the target length.

    It is added to the checker's score (so a wrong answer of the right length still earns a little)
    and is 0 when ``coef`` or ``target`` is 0.
    """
    if coef == 0 or target <= 0:
        return 0.0
    return coef * max(0.0, 1.0 - abs(completion_tokens - target) / target)


class ListedProblems:
    """Tasks read from a file as (prompt, reference) pairs; every tenth one is held out for evaluation."""

    def __init__(self, problems: Sequence[tuple[str, str]], *, name: str, kind: str) -> None:
        if not problems:
            raise NodeError(f"the {kind} task file holds no problems", reason="bad_task_file")
        self.name = name
        self._problems = list(problems)

    def train_ids(self) -> Sequence[int]:
        return [i for i in range(len(self._problems)) if i % 10 != 9] or [0]

    def eval_ids(self) -> Sequence[int]:
        return [i for i in range(len(self._problems)) if i % 10 == 9]

    def _get(self, task_id: int) -> tuple[str, str]:
        if not 0 <= task_id < len(self._problems):
            raise unknown_task(self.name, task_id)
        return self._problems[task_id]

    def prompt(self, task_id: int) -> str:
        return self._get(task_id)[0]
