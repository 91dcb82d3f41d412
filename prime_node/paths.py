"""Where prime-node keeps its files by default (overridable by flags and environment variables)."""

from __future__ import annotations

import os
from pathlib import Path

KEYSTORE_ENV = "PRIME_NODE_KEYSTORE"
PASSWORD_FILE_ENV = "PRIME_NODE_PASSWORD_FILE"
DATA_DIR_ENV = "PRIME_NODE_DATA_DIR"


def default_data_dir() -> Path:
    """``$PRIME_NODE_DATA_DIR``, else the user's data dir (``~/.local/share/prime-node`` on Linux)."""
    explicit = os.environ.get(DATA_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("prime-node", appauthor=False))


def default_keystore_path() -> Path:
    """``$PRIME_NODE_KEYSTORE``, else ``keystore.json`` in the data dir."""
    explicit = os.environ.get(KEYSTORE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    return default_data_dir() / "keystore.json"
