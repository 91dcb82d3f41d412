"""Keystore files on disk: create (atomically, mode 0600, never overwriting) and unlock.

The document format and its cryptography live in crypto/keystore.py; this module owns only files and
passwords. A keystore file is hostile input: size-capped before reading, parsed by the strict decoder.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from crypto.keys import Address, WalletKey
from crypto.keystore import (
    DEFAULT_SCRYPT,
    MAX_DOCUMENT_BYTES,
    ScryptParams,
    decrypt_keystore,
    encrypt_keystore,
    keystore_address,
    parse_keystore_document,
)
from prime_node.atomic_files import fsync_directory, temporary_sibling
from prime_node.errors import NodeError
from prime_node.paths import PASSWORD_FILE_ENV

MAX_PASSWORD_FILE_BYTES = 4096
# geth's --lightkdf cost: for tests and throwaway demo wallets only.
LIGHT_SCRYPT = ScryptParams(n=1 << 12, r=8, p=1)


@dataclass(frozen=True)
class PasswordSource:
    """Where a keystore password comes from. At most one of the three may be set; none means
    ``$PRIME_NODE_PASSWORD_FILE``, else a prompt when a terminal is attached."""

    file: Path | None = None
    env_var: str | None = None
    no_password: bool = False

    def resolve(self, *, confirm: bool = False) -> str:
        chosen = sum([self.file is not None, self.env_var is not None, self.no_password])
        if chosen > 1:
            raise NodeError(
                "give at most one of --password-file, --password-env, --no-password", reason="password_source"
            )
        if self.no_password:
            return ""
        if self.env_var is not None:
            value = os.environ.get(self.env_var)
            if value is None:
                raise NodeError(f"environment variable {self.env_var} is not set", reason="password_source")
            return value
        file = self.file
        if file is None and os.environ.get(PASSWORD_FILE_ENV):
            file = Path(os.environ[PASSWORD_FILE_ENV]).expanduser()
        if file is not None:
            return _read_password_file(file)
        if sys.stdin is not None and sys.stdin.isatty():
            import typer

            return str(typer.prompt("Keystore password", hide_input=True, confirmation_prompt=confirm))
        raise NodeError(
            "no password given and no terminal to ask on: use --password-file, --password-env, "
            f"--no-password or ${PASSWORD_FILE_ENV}",
            reason="password_source",
        )


def _read_password_file(path: Path) -> str:
    """The first line of ``path`` (without its line ending)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as exc:
        raise NodeError(
            f"cannot read password file {path}: {exc.strerror}", reason="password_source"
        ) from exc
    if len(raw) > MAX_PASSWORD_FILE_BYTES:
        raise NodeError(
            f"password file {path} is larger than {MAX_PASSWORD_FILE_BYTES} bytes", reason="password_source"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NodeError(f"password file {path} is not UTF-8 text", reason="password_source") from exc
    lines = text.splitlines()
    return lines[0] if lines else ""


def create_keystore(
    path: Path, key: WalletKey, password: str, *, scrypt: ScryptParams = DEFAULT_SCRYPT
) -> None:
    """Write ``key`` encrypted under ``password`` to ``path``, mode 0600. Refuses to replace any file.

    The file is written to a temporary name and hard-linked into place, so ``path`` either does not exist
    or holds a complete keystore, and a concurrent creator cannot be overwritten.
    """
    if path.exists() or path.is_symlink():
        raise NodeError(
            f"a keystore already exists at {path}; refusing to overwrite it", reason="keystore_exists"
        )
    document = json.dumps(encrypt_keystore(key, password, scrypt=scrypt), indent=2).encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = temporary_sibling(path)
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(document)
                handle.flush()
                os.fsync(handle.fileno())
            _link_without_replacing(temporary, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        fsync_directory(path.parent)
    except OSError as exc:
        raise NodeError(f"cannot write keystore {path}: {exc.strerror}", reason="keystore_io") from exc


def _link_without_replacing(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except FileExistsError as exc:
        raise NodeError(
            f"a keystore already exists at {target}; refusing to overwrite it", reason="keystore_exists"
        ) from exc


def read_keystore_document(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_DOCUMENT_BYTES + 1)
    except FileNotFoundError as exc:
        raise NodeError(
            f"no keystore at {path}; create one with `prime-node wallet new`", reason="no_keystore"
        ) from exc
    except OSError as exc:
        raise NodeError(f"cannot read keystore {path}: {exc.strerror}", reason="keystore_io") from exc
    return parse_keystore_document(raw)


def keystore_file_address(path: Path) -> Address | None:
    """The address a keystore file advertises, without unlocking it (unverified)."""
    return keystore_address(read_keystore_document(path))


def unlock_keystore(path: Path, password: str) -> WalletKey:
    """Read and decrypt the keystore at ``path`` (WrongPasswordError, KeystoreError, NodeError)."""
    return decrypt_keystore(read_keystore_document(path), password)
