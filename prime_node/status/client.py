"""Find a node's status API and fetch its snapshot (stdlib HTTP: the API is local)."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prime_node.errors import NodeError
from prime_node.paths import default_data_dir

MAX_SNAPSHOT_BYTES = 8 << 20


def resolve_api_url(api: str | None, data_dir: Path | None) -> str:
    if api:
        return api.rstrip("/")

    node_file = (data_dir if data_dir is not None else default_data_dir()) / "node.json"
    try:
        document = json.loads(node_file.read_text())
    except FileNotFoundError:
        raise NodeError(
            f"no node.json in {node_file.parent}: is a node running there?", reason="not_running"
        ) from None
    except (OSError, ValueError) as exc:
        raise NodeError(f"cannot read {node_file}: {exc}", reason="not_running") from None
    if (
        not isinstance(document, dict)
        or document.get("state") != "running"
        or not isinstance(document.get("api"), str)
    ):
        raise NodeError(f"the node in {node_file.parent} is not running", reason="not_running")
    return str(document["api"]).rstrip("/")


def fetch_snapshot(url: str, timeout: float = 5.0) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/status", timeout=timeout) as response:
            body = response.read(MAX_SNAPSHOT_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        # HTTPException: a response cut short (IncompleteRead) or malformed, e.g. a node too busy to
        # finish writing its status within its request timeout.
        reason = getattr(exc, "reason", exc)
        raise NodeError(f"cannot reach the status API at {url}: {reason}", reason="api_unreachable") from None
    try:
        data = json.loads(body)
    except ValueError:
        raise NodeError(
            f"the status API at {url} sent something that is not JSON", reason="api_bad_response"
        ) from None
    if not isinstance(data, dict):
        raise NodeError(f"the status API at {url} sent an unexpected document", reason="api_bad_response")
    return data
