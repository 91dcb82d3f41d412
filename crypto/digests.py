"""Hash functions by role: keccak-256 for Ethereum compatibility, BLAKE3 for content addressing, key
derivation and MACs, SHA-256 where outside tooling expects it."""

from __future__ import annotations

import hashlib

import blake3 as _blake3
from Crypto.Hash import keccak as _keccak

DIGEST_SIZE = 32


def keccak256(data: bytes) -> bytes:
    """Ethereum's keccak-256 (the pre-standard SHA-3 padding; not ``hashlib.sha3_256``)."""
    return _keccak.new(data=data, digest_bits=256).digest()


def blake3(data: bytes | bytearray | memoryview) -> bytes:
    """BLAKE3-256: the content hash of pieces, manifests and payloads (2-3x SHA-256 here)."""
    return _blake3.blake3(data).digest()


def blake3_derive_key(context: str, material: bytes, *, length: int = DIGEST_SIZE) -> bytes:
    """BLAKE3 in derive-key mode: ``length`` bytes of key from ``material`` for the purpose ``context``."""
    hasher = _blake3.blake3(derive_key_context=context)
    hasher.update(material)
    return hasher.digest(length=length)


def blake3_hasher() -> _blake3.blake3:
    """An unkeyed BLAKE3 hasher, for content that comes in parts: ``update``, then ``digest``."""
    return _blake3.blake3()


def keyed_blake3(key: bytes) -> _blake3.blake3:
    """A keyed BLAKE3 hasher (a MAC under ``key``): feed it with ``update``, read the tag with ``digest``."""
    return _blake3.blake3(key=key)


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()
