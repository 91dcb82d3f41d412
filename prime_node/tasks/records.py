"""Reading task files (JSONL, or parquet when pyarrow is installed) as lists of dict records."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prime_node.bounded_json import loads_bounded
from prime_node.errors import NodeError

MAX_TASK_FILE_BYTES = 2 << 30


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every record of a .jsonl/.json-lines or .parquet file; NodeError naming the line on bad input."""
    if not path.is_file():
        raise NodeError(f"task file {path} does not exist", reason="bad_task_file")
    if path.stat().st_size > MAX_TASK_FILE_BYTES:
        raise NodeError(
            f"task file {path} is larger than {MAX_TASK_FILE_BYTES} bytes", reason="bad_task_file"
        )
    if path.suffix == ".parquet":
        return _read_parquet(path)
    records: list[dict[str, Any]] = []
    with open(path, encoding="utf-8", errors="strict") as handle:
        try:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    value = loads_bounded(line)
                except ValueError as exc:  # JSONDecodeError is a ValueError
                    why = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
                    raise NodeError(f"{path}:{number}: not JSON: {why}", reason="bad_task_file") from exc
                if not isinstance(value, dict):
                    raise NodeError(
                        f"{path}:{number}: a record must be a JSON object", reason="bad_task_file"
                    )
                records.append(value)
        except UnicodeDecodeError as exc:
            raise NodeError(f"{path}: not UTF-8 text", reason="bad_task_file") from exc
    return records


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise NodeError(
            "reading parquet task files needs pyarrow (pip install 'prime-node[parquet]'), or use JSONL",
            reason="missing_dependency",
        ) from exc
    try:
        rows: list[dict[str, Any]] = pq.read_table(str(path)).to_pylist()
    except Exception as exc:  # pyarrow raises many types on a corrupt file
        raise NodeError(f"{path}: unreadable parquet: {exc}", reason="bad_task_file") from exc
    return rows


def require_text(record: dict[str, Any], keys: tuple[str, ...], where: str) -> str:
    for key in keys:
        value = record.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
    raise NodeError(f"{where}: needs a text field named one of {', '.join(keys)}", reason="bad_task_file")
