from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_node.errors import NodeError
from prime_node.tasks.math import MathTask, answers_match, last_boxed, normalize_answer


def test_last_boxed_handles_nesting_and_picks_the_last() -> None:
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert last_boxed(r"no box here") is None
    assert last_boxed(r"\boxed{unclosed {") is None


@pytest.mark.parametrize(
    ("given", "reference"),
    [
        (r"\dfrac{1}{2}", "0.5"),
        ("3,000", "3000"),
        (r"\text{(B)}", "(B)"),
        ("$x+1$", "x + 1"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        ("90^\\circ", "90"),
        ("2/4", r"\frac{1}{2}"),
        ("5.", "5"),
    ],
)
def test_equivalent_answers_match(given: str, reference: str) -> None:
    assert answers_match(given, reference)


@pytest.mark.parametrize(
    ("given", "reference"), [("3", "4"), ("", ""), ("x+1", "x-1"), (r"\frac{1}{0}", "1")]
)
def test_different_answers_do_not(given: str, reference: str) -> None:
    assert not answers_match(given, reference)


def test_task_from_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "math.jsonl"
    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(12)]
    rows[3] = {"problem": "Half of one?", "solution": r"It is \boxed{\frac{1}{2}}."}
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = MathTask.from_file(path)
    assert len(task.train_ids()) == 11 and list(task.eval_ids()) == [9]
    assert task.prompt(0) == "What is 0+0?"
    assert task.score(5, r"so the answer is \boxed{10}") == 1.0
    assert task.score(5, "10") == 0.0  # the answer must be boxed
    assert task.score(3, r"\boxed{0.5}") == 1.0
    assert normalize_answer(r" \left(3\right) ") == "(3)"


@pytest.mark.parametrize("content", ['{"question": "q"}\n', "not json\n", "[1, 2]\n", ""])
def test_bad_task_files_are_clear_errors(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(NodeError) as info:
        MathTask.from_file(path)
    assert info.value.reason == "bad_task_file"


def test_task_from_parquet_and_a_corrupt_parquet_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    table = pa.table(
        {"problem": [f"{i} squared?" for i in range(10)], "answer": [str(i * i) for i in range(10)]}
    )
    pq.write_table(table, str(path))
    task = MathTask.from_file(path)
    assert task.prompt(3) == "3 squared?" and task.score(3, r"\boxed{9}") == 1.0
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file PAR1")
    with pytest.raises(NodeError) as info:
        MathTask.from_file(bad)
    assert info.value.reason == "bad_task_file"
