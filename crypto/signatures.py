"""Recoverable secp256k1 signatures as Ethereum writes them (r‖s‖v, 65 bytes) and EIP-191 personal_sign.

Verification recovers the signer's address from (digest, signature); a signature "holds" for an address
when the recovery gives exactly that address.
"""

from __future__ import annotations

import coincurve

from crypto.digests import keccak256
from crypto.errors import CryptoError
from crypto.keys import SECP256K1_ORDER, Address, WalletKey, address_from_public_key

SIGNATURE_SIZE = 65
_HALF_ORDER = SECP256K1_ORDER // 2
_EIP191_PREFIX = b"\x19Ethereum Signed Message:\n"


def eip191_digest(message: bytes) -> bytes:
    """The digest personal_sign signs: keccak256("\\x19Ethereum Signed Message:\\n" ‖ len ‖ message)."""
    return keccak256(_EIP191_PREFIX + str(len(message)).encode("ascii") + message)


def sign_message(key: WalletKey, message: bytes) -> bytes:
    """EIP-191 personal_sign: what wallets show as "sign message"."""
    return key.sign_digest(eip191_digest(message))


def recover_address(digest: bytes, signature: bytes, *, strict: bool = True) -> Address:
    """The address whose key made ``signature`` over ``digest``.

    ``strict`` (the protocol's setting) accepts only v in {27, 28} and low s, so every signature has one
    byte form. Lenient mode also takes v in {0, 1} and high s, as some Ethereum tools emit them.
    """
    if len(digest) != 32:
        raise CryptoError("a signed digest is exactly 32 bytes", reason="bad_digest")
    if len(signature) != SIGNATURE_SIZE:
        raise CryptoError(
            f"a signature is {SIGNATURE_SIZE} bytes, got {len(signature)}", reason="bad_signature"
        )
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:64], "big")
    v = signature[64]
    allowed_v = (27, 28) if strict else (0, 1, 27, 28)
    if v not in allowed_v:
        raise CryptoError(f"signature recovery byte v={v} is not one of {allowed_v}", reason="bad_signature")
    if not (0 < r < SECP256K1_ORDER and 0 < s < SECP256K1_ORDER):
        raise CryptoError("signature r or s out of range", reason="bad_signature")
    if strict and s > _HALF_ORDER:
        raise CryptoError("signature has a high s value (malleable form)", reason="bad_signature")
    recovery_id = v - 27 if v >= 27 else v
    try:
        public_key = coincurve.PublicKey.from_signature_and_message(
            signature[:64] + bytes([recovery_id]), digest, hasher=None
        )
    except (ValueError, TypeError) as exc:
        raise CryptoError("no public key recovers from this signature", reason="bad_signature") from exc
    return address_from_public_key(public_key.format(compressed=True))


def verify_message(message: bytes, signature: bytes, address: Address, *, strict: bool = False) -> bool:
    """True when ``signature`` is a personal_sign of ``message`` by ``address``; False on any mismatch."""
    try:
        return recover_address(eip191_digest(message), signature, strict=strict) == address
    except CryptoError:
        return False


def parse_hex_bytes(text: str, *, size: int | None = None, what: str = "value") -> bytes:
    """Decode 0x-prefixed (or bare) hex, with a clear error instead of ValueError."""
    digits = text.strip()
    digits = digits[2:] if digits[:2] in ("0x", "0X") else digits
    try:
        raw = bytes.fromhex(digits)
    except ValueError as exc:
        raise CryptoError(f"{what} is not valid hex", reason="bad_hex") from exc
    if size is not None and len(raw) != size:
        raise CryptoError(f"{what} must be {size} bytes, got {len(raw)}", reason="bad_hex")
    return raw
