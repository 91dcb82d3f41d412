"""secp256k1 wallet keys and Ethereum addresses.

One key per node: its address names the node in every signed message, and the same key is the node's
libp2p identity (see identity.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import coincurve

from crypto.digests import keccak256
from crypto.errors import CryptoError
from crypto.randomness import random_bytes

SECRET_SIZE = 32
ADDRESS_SIZE = 20
COMPRESSED_PUBLIC_KEY_SIZE = 33
UNCOMPRESSED_PUBLIC_KEY_SIZE = 65
SECP256K1_ORDER = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141

_HEX_ADDRESS = re.compile(r"^(0x)?[0-9a-fA-F]{40}$")


@dataclass(frozen=True, order=True)
class Address:
    """A 20-byte Ethereum address. ``str()`` gives the EIP-55 checksummed form."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != ADDRESS_SIZE:
            raise CryptoError("an address is exactly 20 bytes", reason="bad_address")

    @classmethod
    def parse(cls, text: str) -> Address:
        """Parse ``0x``-prefixed hex. Mixed case must carry a valid EIP-55 checksum."""
        text = text.strip()
        if not _HEX_ADDRESS.match(text):
            raise CryptoError(
                f"not an address (want 0x and 40 hex digits): {text[:50]!r}", reason="bad_address"
            )
        digits = text[2:] if text.startswith("0x") else text
        address = cls(bytes.fromhex(digits))
        is_mixed_case = digits != digits.lower() and digits != digits.upper()
        if is_mixed_case and address.checksummed() != "0x" + digits:
            raise CryptoError(f"address fails its EIP-55 checksum: {text}", reason="bad_checksum")
        return address

    def checksummed(self) -> str:
        """EIP-55: hex digits uppercased where the keccak of the lowercase hex has a nibble >= 8."""
        lower = self.raw.hex()
        nibbles = keccak256(lower.encode("ascii")).hex()
        return "0x" + "".join(
            c.upper() if int(n, 16) >= 8 else c for c, n in zip(lower, nibbles[: len(lower)], strict=True)
        )

    def __str__(self) -> str:
        return self.checksummed()


def address_from_public_key(public_key: bytes) -> Address:
    """keccak-256 of the 64-byte uncompressed point, last 20 bytes. Takes either key form."""
    try:
        point = coincurve.PublicKey(public_key).format(compressed=False)
    except (ValueError, TypeError) as exc:
        raise CryptoError("not a valid secp256k1 public key", reason="bad_public_key") from exc
    return Address(keccak256(point[1:])[-ADDRESS_SIZE:])


@dataclass(frozen=True)
class WalletKey:
    """A secp256k1 private key. The secret never appears in repr or logs."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != SECRET_SIZE:
            raise CryptoError("a private key is exactly 32 bytes", reason="bad_private_key")
        if not 0 < int.from_bytes(self.secret, "big") < SECP256K1_ORDER:
            raise CryptoError("private key out of the secp256k1 range", reason="bad_private_key")

    @classmethod
    def generate(cls) -> WalletKey:
        while True:  # a 32-byte draw falls outside [1, n) with probability ~2^-128
            secret = random_bytes(SECRET_SIZE)
            if 0 < int.from_bytes(secret, "big") < SECP256K1_ORDER:
                return cls(secret)

    # Derived values are cached: the key is immutable, and signing hot paths ask for them every time.
    @cached_property
    def _signer(self) -> coincurve.PrivateKey:
        return coincurve.PrivateKey(self.secret)

    @cached_property
    def public_key(self) -> bytes:
        """Compressed (33-byte) public key: the form libp2p puts in peer IDs."""
        return bytes(self._signer.public_key.format(compressed=True))

    @cached_property
    def address(self) -> Address:
        return address_from_public_key(self.public_key)

    def sign_digest(self, digest: bytes) -> bytes:
        """Recoverable signature r‖s‖v over a 32-byte digest, v = 27 + recovery id (Ethereum's form).

        libsecp256k1 always produces low-s signatures, which is what verifiers here require.
        """
        if len(digest) != 32:
            raise CryptoError("a signed digest is exactly 32 bytes", reason="bad_digest")
        signature = self._signer.sign_recoverable(digest, hasher=None)
        return signature[:64] + bytes([27 + signature[64]])
