"""The Kademlia key under which a name (a run: ``/prime-node/run/<run>``) is provided and looked up.

Standard DHT servers (go-libp2p, js-libp2p) take a provider key only if it is a multihash, the hash of a
CID, and reset a stream whose ADD_PROVIDER or GET_PROVIDERS carries anything else: with the name's raw
UTF-8 bytes as the key our providers could not live on the public DHT (issue 36). So a name is provided
under the sha2-256 multihash of its UTF-8 bytes (``0x12 0x20`` + the 32-byte digest), which is what
go-libp2p's routing discovery (``nsToCid``: a CIDv1, raw codec, of that multihash) advertises a namespace
under: a go or js peer that looks the name up the standard way finds our providers.
"""

from __future__ import annotations

import base64
import hashlib

SHA2_256 = 0x12
SHA2_256_LENGTH = 32
MULTIHASH_PREFIX = bytes((SHA2_256, SHA2_256_LENGTH))
CID_V1 = 0x01
RAW_CODEC = 0x55


def provider_key(name: str) -> bytes:
    """The DHT key of ``name``: the sha2-256 multihash of its UTF-8 bytes."""
    return MULTIHASH_PREFIX + hashlib.sha256(name.encode()).digest()


def is_sha256_multihash(key: bytes) -> bool:
    """Whether ``key`` is a sha2-256 multihash (what a standard DHT server accepts as a provider key)."""
    return len(key) == len(MULTIHASH_PREFIX) + SHA2_256_LENGTH and key.startswith(MULTIHASH_PREFIX)


def provider_cid(name: str) -> str:
    """``name``'s key as a CIDv1 (raw codec, base32 ``b…``), the form other libp2p tools print and take."""
    raw = bytes((CID_V1, RAW_CODEC)) + provider_key(name)
    return "b" + base64.b32encode(raw).decode().lower().rstrip("=")
