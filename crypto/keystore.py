"""Ethereum keystore v3 (the "Web3 Secret Storage" format): encrypt and decrypt a wallet key.

Pure: documents in, documents out; files are the caller's business (prime_node/wallet_store.py). Any
Ethereum wallet can import what we write, and we read what they write (scrypt or pbkdf2, aes-128-ctr).
A keystore read from disk is hostile input: every field is type- and range-checked, and the key
derivation's cost is capped before it runs, so a crafted file cannot exhaust memory or time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import uuid
from dataclasses import dataclass
from typing import Any

from Crypto.Cipher import AES
from Crypto.Util import Counter

from crypto.digests import keccak256
from crypto.errors import CryptoError, KeystoreError, WrongPasswordError
from crypto.keys import Address, WalletKey
from crypto.randomness import random_bytes

MAX_DOCUMENT_BYTES = 64 * 1024
# Ceilings on what a keystore may ask of us: 1 GiB of scrypt memory, 10 M pbkdf2 rounds.
MAX_SCRYPT_MEMORY = 1 << 30
MAX_SCRYPT_P = 16
MAX_PBKDF2_ROUNDS = 10_000_000


@dataclass(frozen=True)
class ScryptParams:
    """scrypt cost. The default (n = 2^18, r = 8, p = 1) is geth's standard: ~1 s and 256 MiB here."""

    n: int = 1 << 18
    r: int = 8
    p: int = 1

    def memory_bytes(self) -> int:
        return 128 * self.n * self.r * self.p

    def check(self) -> None:
        n_is_power_of_two = self.n >= 2 and self.n & (self.n - 1) == 0
        if not n_is_power_of_two or not 1 <= self.r <= 64 or not 1 <= self.p <= MAX_SCRYPT_P:
            raise KeystoreError(f"scrypt parameters out of range: {self}", reason="unsupported_kdf")
        if self.memory_bytes() > MAX_SCRYPT_MEMORY:
            raise KeystoreError(
                f"scrypt parameters ask for {self.memory_bytes() >> 20} MiB, more than the "
                f"{MAX_SCRYPT_MEMORY >> 20} MiB allowed",
                reason="unsupported_kdf",
            )


DEFAULT_SCRYPT = ScryptParams()
# Light parameters for tests and benchmarks only (milliseconds instead of a second).
TEST_SCRYPT = ScryptParams(n=1 << 10, r=8, p=1)


def _scrypt(password: bytes, salt: bytes, params: ScryptParams, dklen: int) -> bytes:
    params.check()
    return hashlib.scrypt(
        password,
        salt=salt,
        n=params.n,
        r=params.r,
        p=params.p,
        dklen=dklen,
        maxmem=params.memory_bytes() + (64 << 20),
    )


def _aes_128_ctr(key: bytes, iv: bytes, data: bytes) -> bytes:
    counter = Counter.new(128, initial_value=int.from_bytes(iv, "big"))
    return AES.new(key, AES.MODE_CTR, counter=counter).encrypt(data)


def encrypt_keystore(
    key: WalletKey,
    password: str,
    *,
    scrypt: ScryptParams = DEFAULT_SCRYPT,
    salt: bytes | None = None,
    iv: bytes | None = None,
    key_id: str | None = None,
) -> dict[str, Any]:
    """A keystore v3 document (a JSON-ready dict) holding ``key`` under ``password``."""
    salt = random_bytes(32) if salt is None else salt
    iv = random_bytes(16) if iv is None else iv
    derived = _scrypt(password.encode("utf-8"), salt, scrypt, 32)
    ciphertext = _aes_128_ctr(derived[:16], iv, key.secret)
    return {
        "version": 3,
        "id": key_id or str(uuid.UUID(bytes=random_bytes(16), version=4)),
        "address": key.address.raw.hex(),
        "crypto": {
            "cipher": "aes-128-ctr",
            "cipherparams": {"iv": iv.hex()},
            "ciphertext": ciphertext.hex(),
            "kdf": "scrypt",
            "kdfparams": {"dklen": 32, "n": scrypt.n, "r": scrypt.r, "p": scrypt.p, "salt": salt.hex()},
            "mac": keccak256(derived[16:32] + ciphertext).hex(),
        },
    }


def parse_keystore_document(data: bytes | str) -> dict[str, Any]:
    """Parse keystore JSON with a size cap; anything but a JSON object is a KeystoreError."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if len(raw) > MAX_DOCUMENT_BYTES:
        raise KeystoreError(f"keystore is {len(raw)} bytes, more than {MAX_DOCUMENT_BYTES}", reason="corrupt")
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise KeystoreError("keystore is not valid JSON (truncated or corrupt?)", reason="corrupt") from exc
    if not isinstance(document, dict):
        raise KeystoreError("keystore JSON is not an object", reason="corrupt")
    return document


def keystore_address(document: dict[str, Any]) -> Address | None:
    """The plaintext address a keystore advertises (unverified until decryption), if it has one."""
    text = document.get("address")
    if not isinstance(text, str):
        return None
    try:
        return Address.parse(text)
    except CryptoError:
        return None


def decrypt_keystore(document: dict[str, Any], password: str) -> WalletKey:
    """The wallet key in ``document``: WrongPasswordError on a MAC mismatch, KeystoreError otherwise."""
    if document.get("version") != 3:
        raise KeystoreError("not a version 3 keystore", reason="unsupported_version")
    section = document.get("crypto", document.get("Crypto"))
    if not isinstance(section, dict):
        raise KeystoreError("keystore has no crypto section", reason="corrupt")
    if section.get("cipher") != "aes-128-ctr":
        raise KeystoreError(f"unsupported cipher {section.get('cipher')!r}", reason="unsupported_cipher")
    iv = _hex_field(_dict_field(section, "cipherparams"), "iv", size=16)
    ciphertext = _hex_field(section, "ciphertext", size=32)
    mac = _hex_field(section, "mac", size=32)
    derived = _derive_key(section, password.encode("utf-8"))
    if not hmac.compare_digest(keccak256(derived[16:32] + ciphertext), mac):
        raise WrongPasswordError()
    try:
        key = WalletKey(_aes_128_ctr(derived[:16], iv, ciphertext))
    except CryptoError as exc:
        raise KeystoreError("keystore decrypts to an invalid private key", reason="corrupt") from exc
    claimed = keystore_address(document)
    if claimed is not None and claimed != key.address:
        raise KeystoreError(
            f"keystore claims address {claimed} but holds the key of {key.address}", reason="address_mismatch"
        )
    return key


def _derive_key(section: dict[str, Any], password: bytes) -> bytes:
    params = _dict_field(section, "kdfparams")
    if params.get("dklen") != 32:
        raise KeystoreError("kdf dklen must be 32", reason="unsupported_kdf")
    salt = _hex_field(params, "salt")
    if not 1 <= len(salt) <= 1024:
        raise KeystoreError("kdf salt length out of range", reason="corrupt")
    kdf = section.get("kdf")
    if kdf == "scrypt":
        scrypt = ScryptParams(n=_int_field(params, "n"), r=_int_field(params, "r"), p=_int_field(params, "p"))
        return _scrypt(password, salt, scrypt, 32)
    if kdf == "pbkdf2":
        if params.get("prf") != "hmac-sha256":
            raise KeystoreError(f"unsupported pbkdf2 prf {params.get('prf')!r}", reason="unsupported_kdf")
        rounds = _int_field(params, "c")
        if not 1 <= rounds <= MAX_PBKDF2_ROUNDS:
            raise KeystoreError(f"pbkdf2 round count {rounds} out of range", reason="unsupported_kdf")
        return hashlib.pbkdf2_hmac("sha256", password, salt, rounds, 32)
    raise KeystoreError(f"unsupported kdf {kdf!r}", reason="unsupported_kdf")


def _dict_field(section: dict[str, Any], name: str) -> dict[str, Any]:
    value = section.get(name)
    if not isinstance(value, dict):
        raise KeystoreError(f"keystore field {name!r} missing or not an object", reason="corrupt")
    return value


def _int_field(section: dict[str, Any], name: str) -> int:
    value = section.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise KeystoreError(f"keystore field {name!r} missing or not an integer", reason="corrupt")
    return value


def _hex_field(section: dict[str, Any], name: str, *, size: int | None = None) -> bytes:
    value = section.get(name)
    if not isinstance(value, str) or len(value) > 4096:
        raise KeystoreError(f"keystore field {name!r} missing or not a hex string", reason="corrupt")
    try:
        raw = bytes.fromhex(value[2:] if value.startswith("0x") else value)
    except ValueError as exc:
        raise KeystoreError(f"keystore field {name!r} is not valid hex", reason="corrupt") from exc
    if size is not None and len(raw) != size:
        raise KeystoreError(f"keystore field {name!r} must be {size} bytes, got {len(raw)}", reason="corrupt")
    return raw
