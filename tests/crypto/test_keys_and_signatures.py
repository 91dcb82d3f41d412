"""Our keys, addresses and EIP-191 signatures against eth-account, an independent Ethereum implementation."""

from __future__ import annotations

import contextlib

import pytest
from eth_account import Account
from eth_account.messages import encode_defunct
from hypothesis import given
from hypothesis import strategies as st

from crypto.errors import CryptoError
from crypto.keys import SECP256K1_ORDER, Address, WalletKey
from crypto.signatures import eip191_digest, parse_hex_bytes, recover_address, sign_message, verify_message

secrets = st.integers(1, SECP256K1_ORDER - 1).map(lambda n: WalletKey(n.to_bytes(32, "big")))


@given(key=secrets)
def test_address_matches_eth_account(key: WalletKey) -> None:
    assert str(key.address) == Account.from_key(key.secret).address


@given(key=secrets, message=st.binary(max_size=300))
def test_our_signature_verifies_in_eth_account(key: WalletKey, message: bytes) -> None:
    signature = sign_message(key, message)
    assert len(signature) == 65
    assert Account.recover_message(encode_defunct(primitive=message), signature=signature) == str(key.address)


@given(key=secrets, message=st.binary(max_size=300))
def test_eth_account_signature_verifies_here(key: WalletKey, message: bytes) -> None:
    theirs = bytes(Account.sign_message(encode_defunct(primitive=message), key.secret).signature)
    assert verify_message(message, theirs, key.address)
    assert recover_address(eip191_digest(message), theirs) == key.address


@given(key=secrets, other=secrets, message=st.binary(max_size=64))
def test_signature_does_not_hold_for_another_address_or_message(
    key: WalletKey, other: WalletKey, message: bytes
) -> None:
    signature = sign_message(key, message)
    if other != key:
        assert not verify_message(message, signature, other.address)
    assert not verify_message(message + b"!", signature, key.address)


def test_strict_recovery_refuses_malleable_and_foreign_forms() -> None:
    key = WalletKey.generate()
    digest = eip191_digest(b"m")
    signature = key.sign_digest(digest)
    r, s, v = signature[:32], int.from_bytes(signature[32:64], "big"), signature[64]
    high_s = r + (SECP256K1_ORDER - s).to_bytes(32, "big") + bytes([55 - v])  # same key, other s and parity
    assert recover_address(digest, high_s, strict=False) == key.address
    with pytest.raises(CryptoError, match="high s"):
        recover_address(digest, high_s)
    zero_one_v = signature[:64] + bytes([v - 27])
    assert recover_address(digest, zero_one_v, strict=False) == key.address
    with pytest.raises(CryptoError, match="recovery byte"):
        recover_address(digest, zero_one_v)
    for bad in (signature[:64], b"\0" * 65, signature[:64] + b"\x05"):
        with pytest.raises(CryptoError):
            recover_address(digest, bad)


def test_address_parsing_enforces_eip55_checksum() -> None:
    key = WalletKey.generate()
    text = str(key.address)
    assert Address.parse(text) == key.address
    assert Address.parse(text.lower()) == key.address
    assert Address.parse("0x" + text[2:].upper()) == key.address
    letters = [i for i, c in enumerate(text) if c.isalpha() and i > 1]
    if letters:
        i = letters[0]
        flipped = text[:i] + text[i].swapcase() + text[i + 1 :]
        if flipped[2:] not in (flipped[2:].lower(), flipped[2:].upper()):
            with pytest.raises(CryptoError, match="checksum"):
                Address.parse(flipped)
    for bad in ("", "0x", "0x123", "0x" + "g" * 40, text + "00"):
        with pytest.raises(CryptoError):
            Address.parse(bad)


def test_invalid_private_keys_are_refused() -> None:
    for bad in (b"", b"\0" * 32, SECP256K1_ORDER.to_bytes(32, "big"), b"\1" * 31):
        with pytest.raises(CryptoError):
            WalletKey(bad)


def test_secret_never_in_repr() -> None:
    key = WalletKey.generate()
    assert key.secret.hex() not in repr(key)


@given(st.text(max_size=80))
def test_hex_parsing_fails_only_with_crypto_error(text: str) -> None:
    with contextlib.suppress(CryptoError):
        parse_hex_bytes(text)
