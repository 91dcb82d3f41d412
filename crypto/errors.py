"""The one error root of crypto/: every failure on key material, signatures or keystores is a CryptoError.

Callers branch on ``reason`` (a short stable code), never on message text.
"""

from __future__ import annotations


class CryptoError(Exception):
    """Bad key material, a malformed or non-matching signature, an unreadable keystore."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class KeystoreError(CryptoError):
    """A keystore document that cannot be decrypted: corrupt, unsupported or hostile."""


class WrongPasswordError(KeystoreError):
    """The keystore is well-formed but its MAC does not match: the password is wrong."""

    def __init__(self) -> None:
        super().__init__("wrong password for this keystore", reason="wrong_password")
