"""Build the task source a run config names."""

from __future__ import annotations

from prime_node.config import TaskConfig
from prime_node.tasks.base import TaskSource


def build_task(config: TaskConfig) -> TaskSource:
    if config.kind == "arithmetic":
        from prime_node.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(config.digits, config.reverse_answer)
    assert config.path is not None  # enforced by TaskConfig
    if config.kind == "math":
        from prime_node.tasks.math import MathTask

        return MathTask.from_file(config.path)
    from prime_node.tasks.code import CodeTask

    return CodeTask.from_file(config.path, timeout_s=config.code_timeout_s, memory_mb=config.code_memory_mb)
