"""Python code tasks: the completion's program must pass the task's tests in the sandbox.

Records: ``{"prompt": str, "tests": str}`` where ``tests`` is Python (typically ``assert`` lines) run
after the candidate code in one program. The code is the last fenced ```python block of the completion,
or the whole completion if it has no fence. Exit status 0 within the time limit scores 1.0; anything
else (failure, exception, timeout, memory exhaustion, crash) scores 0.0 — never an error in the trainer.
Ids are record positions; every 10th is held out.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

from prime_node.errors import NodeError
from prime_node.tasks.base import ListedProblems
from prime_node.tasks.records import read_records, require_text
from prime_node.tasks.sandbox import check_sandbox, run_python

log = logging.getLogger(__name__)
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
MAX_CODE_CHARS = 200_000


def extract_code(completion: str) -> str:
    blocks = _FENCE.findall(completion)
    return str(blocks[-1]) if blocks else completion


class CodeTask(ListedProblems):
    def __init__(
        self,
        problems: Sequence[tuple[str, str]],
        *,
        timeout_s: float = 5.0,
        memory_mb: int = 512,
        name: str = "code",
    ) -> None:
        check_sandbox()  # refuse now, clearly, where completions could not be confined
        super().__init__(problems, name=name, kind="code")
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb

    @classmethod
    def from_file(cls, path: Path, *, timeout_s: float = 5.0, memory_mb: int = 512) -> CodeTask:
        problems = []
        for number, record in enumerate(read_records(path), start=1):
            where = f"{path} record {number}"
            problems.append(
                (
                    require_text(record, ("prompt", "question"), where),
                    require_text(record, ("tests", "test"), where),
                )
            )
        return cls(problems, timeout_s=timeout_s, memory_mb=memory_mb, name=f"code:{path.name}")

    def record(self, task_id: int) -> dict[str, str]:
        """The task as a record of this class's file format (the filter writes these)."""
        prompt, tests = self._get(task_id)
        return {"prompt": prompt, "tests": tests}

    def score(self, task_id: int, completion: str) -> float:
        tests = self._get(task_id)[1]
        code = extract_code(completion)
        if len(code) > MAX_CODE_CHARS or "\x00" in code:
            return 0.0
        try:
            result = run_python(
                code + "\n\n" + tests + "\n", timeout_s=self.timeout_s, memory_mb=self.memory_mb
            )
        except (OSError, NodeError) as exc:  # the sandbox itself failed: no reward, but say so
            log.warning("code task %d: sandbox failure: %s", task_id, exc)
            return 0.0
        return 1.0 if result.passed else 0.0
