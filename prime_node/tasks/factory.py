"""Build the task source a run config names."""

from __future__ import annotations

from prime_node.config import TaskConfig
from prime_node.tasks.arithmetic import ArithmeticTask
from prime_node.tasks.base import TaskSource
from prime_node.tasks.code import CodeTask
from prime_node.tasks.math import MathTask


def build_task(config: TaskConfig) -> TaskSource:
    if config.kind == "arithmetic":
        return ArithmeticTask(config.digits, config.reverse_answer)
    assert config.path is not None  # enforced by TaskConfig
    if config.kind == "math":
        return MathTask.from_file(config.path, chat=config.chat)

    return CodeTask.from_file(config.path, timeout_s=config.code_timeout_s, memory_mb=config.code_memory_mb)
