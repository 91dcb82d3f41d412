"""Key agreement for authenticated channels: one-connection secp256k1 keys and their ECDH.

Pure: the caller draws the ephemeral secret (``crypto.randomness.random_bytes``) and passes it in, so
handshakes stay deterministic under test.
"""

from __future__ import annotations

import coincurve

from crypto.errors import CryptoError

EPHEMERAL_KEY_SIZE = 33
"""A compressed secp256k1 public key."""


def check_public_key(public_key: bytes) -> None:
    """CryptoError(reason="bad_key") unless ``public_key`` is a point on secp256k1."""
    try:
        coincurve.PublicKey(public_key)
    except (ValueError, TypeError) as exc:
        raise CryptoError("not a secp256k1 curve point", reason="bad_key") from exc


class EphemeralKey:
    """A secp256k1 key for one connection only: its public half, and the secret shared with a peer's."""

    def __init__(self, secret: bytes) -> None:
        try:
            self._key = coincurve.PrivateKey(secret)
        except (ValueError, TypeError) as exc:
            raise CryptoError("not a usable secp256k1 secret", reason="bad_private_key") from exc
        self.public_key = self._key.public_key.format(compressed=True)

    def __repr__(self) -> str:
        return f"EphemeralKey(public_key={self.public_key.hex()})"

    def shared_secret(self, peer_public_key: bytes) -> bytes:
        """ECDH with the peer's compressed public key: SHA-256 of the shared point (libsecp256k1's way)."""
        try:
            return bytes(self._key.ecdh(peer_public_key))
        except (ValueError, TypeError) as exc:
            raise CryptoError("peer key is not a secp256k1 curve point", reason="bad_key") from exc
