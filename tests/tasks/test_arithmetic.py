from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prime_node.errors import NodeError
from prime_node.tasks.arithmetic import ArithmeticTask
from prime_node.tasks.base import length_bonus


def test_prompts_answers_and_split() -> None:
    task = ArithmeticTask(digits=2)
    task_id = 37 * 100 + 48
    assert task.prompt(task_id) == "37+48="
    assert task.prompt(7 * 100 + 5) == "07+05="
    assert task.answer(task_id) == "58"  # 85, least-significant digit first
    assert ArithmeticTask(digits=2, reverse_answer=False).answer(task_id) == "85"
    train, held_out = set(task.train_ids()), set(task.eval_ids())
    assert not train & held_out and len(train) + len(held_out) == 10_000
    assert 0.07 < len(held_out) / 10_000 < 0.13


@given(st.integers(0, 9999), st.text(max_size=12))
def test_score_is_one_exactly_for_the_answer(task_id: int, text: str) -> None:
    task = ArithmeticTask()
    assert task.score(task_id, task.answer(task_id)) == 1.0
    assert task.score(task_id, text) == (1.0 if text.strip() == task.answer(task_id) else 0.0)


def test_unknown_ids_are_refused() -> None:
    with pytest.raises(NodeError) as info:
        ArithmeticTask().prompt(10_000)
    assert info.value.reason == "unknown_task"


def test_length_bonus_peaks_at_the_target() -> None:
    assert length_bonus(10, target=10, coef=0.5) == 0.5
    assert length_bonus(5, target=10, coef=0.5) == 0.25
    assert length_bonus(30, target=10, coef=0.5) == 0.0
    assert length_bonus(10, target=0, coef=0.5) == 0.0
