"""Typed run configuration (pydantic, TOML, env overrides). Importable without torch."""

from prime_node.config.run import LengthRewardConfig, RunConfig, TaskConfig, load_run_config

__all__ = ["LengthRewardConfig", "RunConfig", "TaskConfig", "load_run_config"]
