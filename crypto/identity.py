"""The libp2p peer ID of a wallet key, and the way back from a peer ID to an Ethereum address.

libp2p names a peer by a multihash of its protobuf-encoded public key. For a compressed secp256k1 key
that encoding is 37 bytes, short enough that libp2p uses the *identity* multihash: the peer ID contains
the public key itself. So peer ID → public key → address is a pure function, and a Noise handshake that
proves the peer ID also proves the address. Peer IDs of this kind print as ``16Uiu2…``.
"""

from __future__ import annotations

import functools

from crypto.errors import CryptoError
from crypto.keys import COMPRESSED_PUBLIC_KEY_SIZE, Address, address_from_public_key

_KEY_TYPE_SECP256K1 = 2
# protobuf PublicKey { Type = 1 (varint): Secp256k1; Data = 2 (bytes, 33) }
_PROTOBUF_PREFIX = bytes([0x08, _KEY_TYPE_SECP256K1, 0x12, COMPRESSED_PUBLIC_KEY_SIZE])
_IDENTITY_MULTIHASH = 0x00
_ENCODED_KEY_SIZE = len(_PROTOBUF_PREFIX) + COMPRESSED_PUBLIC_KEY_SIZE
_MAX_PEER_ID_CHARS = 128

_BASE58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_BASE58_INDEX = {c: i for i, c in enumerate(_BASE58_ALPHABET)}


def base58_encode(data: bytes) -> str:
    """Bitcoin-alphabet base58 (what libp2p prints peer IDs in)."""
    leading_zeros = len(data) - len(data.lstrip(b"\0"))
    number = int.from_bytes(data, "big")
    digits = []
    while number:
        number, remainder = divmod(number, 58)
        digits.append(_BASE58_ALPHABET[remainder])
    return "1" * leading_zeros + "".join(reversed(digits))


def base58_decode(text: str) -> bytes:
    number = 0
    for char in text:
        if char not in _BASE58_INDEX:
            raise CryptoError(f"invalid base58 character {char!r}", reason="bad_peer_id")
        number = number * 58 + _BASE58_INDEX[char]
    leading_zeros = len(text) - len(text.lstrip("1"))
    body = number.to_bytes((number.bit_length() + 7) // 8, "big") if number else b""
    return b"\0" * leading_zeros + body


def peer_id_bytes(public_key: bytes) -> bytes:
    """The binary peer ID (identity multihash of the protobuf key) for a compressed secp256k1 key."""
    if len(public_key) != COMPRESSED_PUBLIC_KEY_SIZE:
        raise CryptoError("a peer ID is made from a 33-byte compressed key", reason="bad_public_key")
    address_from_public_key(public_key)  # validates that the point is on the curve
    return bytes([_IDENTITY_MULTIHASH, _ENCODED_KEY_SIZE]) + _PROTOBUF_PREFIX + public_key


def peer_id_from_public_key(public_key: bytes) -> str:
    return base58_encode(peer_id_bytes(public_key))


def public_key_from_peer_id(peer_id: str) -> bytes:
    """The compressed secp256k1 key inside a peer ID; CryptoError for any other kind of peer ID."""
    return _decode_peer_id(peer_id)[0]


def address_from_peer_id(peer_id: str) -> Address:
    return _decode_peer_id(peer_id)[1]


@functools.lru_cache(maxsize=4096)
def _decode_peer_id(peer_id: str) -> tuple[bytes, Address]:
    """Key and address behind a peer ID. Cached because every peer record and envelope names a peer ID,
    the same few thousand over and over, and each decode costs a base58 loop, a curve-point
    decompression and a Keccak hash (measured: ~8 % of a node's CPU during a broadcast). Failures are
    not cached, so a bad peer ID costs what it always did; the cache holds at most 4096 entries."""
    if not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise CryptoError("peer ID length out of range", reason="bad_peer_id")
    raw = base58_decode(peer_id)
    header = bytes([_IDENTITY_MULTIHASH, _ENCODED_KEY_SIZE]) + _PROTOBUF_PREFIX
    if len(raw) != len(header) + COMPRESSED_PUBLIC_KEY_SIZE or not raw.startswith(header):
        raise CryptoError("not the peer ID of a secp256k1 wallet key", reason="bad_peer_id")
    public_key = raw[len(header) :]
    return public_key, address_from_public_key(public_key)
