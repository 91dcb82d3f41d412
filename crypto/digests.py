"""Hash functions by role: keccak-256 for Ethereum compatibility, BLAKE3 for content addressing, SHA-256
where outside tooling expects it."""

from __future__ import annotations

import hashlib

import blake3 as _blake3
from Crypto.Hash import keccak as _keccak

DIGEST_SIZE = 32


def keccak256(data: bytes) -> bytes:
    """Ethereum's keccak-256 (the pre-standard SHA-3 padding; not ``hashlib.sha3_256``)."""
    return _keccak.new(data=data, digest_bits=256).digest()


def blake3(data: bytes) -> bytes:
    """BLAKE3-256: the content hash of pieces, manifests and payloads (2-3x SHA-256 here)."""
    return _blake3.blake3(data).digest()


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
