"""Write prime_node/assets/tokenizer_corpus/*.txt: the text the byte-level BPE tokenizer is trained on.

Everything comes from this project, so nothing external is copied or downloaded:
- ``code.txt``: the project's own Python modules (prime_node/, sorted by path, docstrings included);
- ``docs.txt``: the project's own documentation (docs/*.md), English prose with Markdown;
- ``tasks.txt``: prompts and answers of the project's task generators (arithmetic) and math problems
  generated from templates below, answered in ``\\boxed{}`` inside user/assistant turns;
- ``handwritten.txt`` is written by hand and kept as is (a little non-ASCII text).

Each generated file is capped so the corpus stays under ~300 KB. Run from the repository root:
``python scripts/make_tokenizer_corpus.py``; the output is deterministic for a given checkout.
"""

from __future__ import annotations

import random
from pathlib import Path

from prime_node.tasks.arithmetic import ArithmeticTask

OUT = Path("prime_node/assets/tokenizer_corpus")
CODE_BYTES = 120_000
DOCS_BYTES = 90_000
TASK_BYTES = 45_000


def _capped(paths: list[Path], limit: int) -> str:
    parts: list[str] = []
    size = 0
    for path in paths:
        text = path.read_text(encoding="utf-8")
        if size + len(text.encode()) > limit:
            continue
        parts.append(text)
        size += len(text.encode())
    return "\n".join(parts)


def _math_problem(rng: random.Random) -> tuple[str, str]:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 9)
    kind = rng.randrange(6)
    if kind == 0:
        return f"What is {a} times {b}?", str(a * b)
    if kind == 1:
        return f"Solve for $x$: ${c}x + {a} = {c * b + a}$.", str(b)
    if kind == 2:
        return f"Simplify $\\frac{{{a * c}}}{{{b * c}}}$.", f"\\frac{{{a}}}{{{b}}}"
    if kind == 3:
        return f"A box holds {a} apples. {b} more boxes arrive. How many apples are there in all?", str(
            a * (b + 1)
        )
    if kind == 4:
        return f"What is the remainder when {a * b + c} is divided by {b}?", str((a * b + c) % b)
    return f"Compute ${a}^2 - {b}^2$.", str(a * a - b * b)


def _tasks_text() -> str:
    rng = random.Random(14)
    lines: list[str] = []
    arithmetic = ArithmeticTask(digits=2, reverse_answer=False)
    for task_id in arithmetic.train_ids()[::97]:
        lines.append(f"{arithmetic.prompt(task_id)}{arithmetic.answer(task_id)}")
    while sum(len(line) + 1 for line in lines) < TASK_BYTES:
        question, answer = _math_problem(rng)
        lines.append(
            f"user\n{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}.\n"
            f"assistant\nWorking it out, the answer is $\\boxed{{{answer}}}$.\n"
        )
    return "\n".join(lines)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    code = sorted(Path("prime_node").rglob("*.py"))
    (OUT / "code.txt").write_text(_capped(code, CODE_BYTES), encoding="utf-8")
    (OUT / "docs.txt").write_text(_capped(sorted(Path("docs").glob("*.md")), DOCS_BYTES), encoding="utf-8")
    (OUT / "tasks.txt").write_text(_tasks_text(), encoding="utf-8")
    for path in sorted(OUT.glob("*.txt")):
        print(f"{path}  {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
