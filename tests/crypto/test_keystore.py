"""Keystore v3: ours opens in eth-account, theirs opens here, and hostile documents fail cleanly."""

from __future__ import annotations

import copy
import hashlib
import json

import pytest
from eth_account import Account
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.errors import KeystoreError, WrongPasswordError
from crypto.keys import WalletKey
from crypto.keystore import TEST_SCRYPT, decrypt_keystore, encrypt_keystore, parse_keystore_document

KEY = WalletKey.generate()
DOCUMENT = encrypt_keystore(KEY, "correct horse", scrypt=TEST_SCRYPT)


def test_our_keystore_opens_in_eth_account() -> None:
    assert Account.decrypt(DOCUMENT, "correct horse") == KEY.secret
    assert DOCUMENT["address"] == KEY.address.raw.hex()


@pytest.mark.parametrize("kdf", ["scrypt", "pbkdf2"])
def test_eth_account_keystore_opens_here(kdf: str) -> None:
    theirs = Account.encrypt(KEY.secret, "pw", kdf=kdf, iterations=1024 if kdf == "scrypt" else 2048)
    assert decrypt_keystore(json.loads(json.dumps(theirs)), "pw") == KEY


def test_default_parameters_are_geths_standard() -> None:
    document = encrypt_keystore(KEY, "", scrypt=TEST_SCRYPT)
    params = document["crypto"]["kdfparams"]
    assert (document["crypto"]["cipher"], document["crypto"]["kdf"], params["dklen"]) == (
        "aes-128-ctr",
        "scrypt",
        32,
    )
    from crypto.keystore import ScryptParams

    assert (ScryptParams().n, ScryptParams().r, ScryptParams().p) == (1 << 18, 8, 1)


def test_wrong_password() -> None:
    with pytest.raises(WrongPasswordError):
        decrypt_keystore(DOCUMENT, "wrong")


def test_empty_password_round_trip() -> None:
    document = encrypt_keystore(KEY, "", scrypt=TEST_SCRYPT)
    assert decrypt_keystore(document, "") == KEY


@given(cut=st.integers(0, len(json.dumps(DOCUMENT)) - 1))
def test_truncated_document_is_a_keystore_error(cut: int) -> None:
    with pytest.raises(KeystoreError):
        decrypt_keystore(parse_keystore_document(json.dumps(DOCUMENT)[:cut]), "correct horse")


def _with(path: tuple[str, ...], value: object) -> dict[str, object]:
    document = copy.deepcopy(DOCUMENT)
    target = document
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = value
    return document


@pytest.mark.parametrize(
    ("path", "value", "reason"),
    [
        (("version",), 4, "unsupported_version"),
        (("crypto",), "x", "corrupt"),
        (("crypto", "cipher"), "aes-256-gcm", "unsupported_cipher"),
        (("crypto", "ciphertext"), "zz", "corrupt"),
        (("crypto", "ciphertext"), "00" * 31, "corrupt"),
        (("crypto", "mac"), 7, "corrupt"),
        (("crypto", "cipherparams", "iv"), "00", "corrupt"),
        (("crypto", "kdf"), "argon2", "unsupported_kdf"),
        (("crypto", "kdfparams", "dklen"), 64, "unsupported_kdf"),
        (("crypto", "kdfparams", "n"), 1000, "unsupported_kdf"),
        (("crypto", "kdfparams", "n"), True, "corrupt"),
        (("crypto", "kdfparams", "salt"), "", "corrupt"),
    ],
)
def test_corrupt_fields_give_reasons(path: tuple[str, ...], value: object, reason: str) -> None:
    with pytest.raises(KeystoreError) as caught:
        decrypt_keystore(_with(path, value), "correct horse")
    assert caught.value.reason == reason


def test_hostile_kdf_cost_is_refused_before_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused up front, not after burning the cost: no key derivation runs at all (a hostile cost that got
    through would spend minutes and GiBs here)."""
    derivations: list[str] = []
    monkeypatch.setattr(hashlib, "scrypt", lambda *a, **k: derivations.append("scrypt") or b"")
    monkeypatch.setattr(hashlib, "pbkdf2_hmac", lambda *a, **k: derivations.append("pbkdf2") or b"")
    for n, r, p in ((1 << 30, 8, 1), (1 << 20, 64, 1), (1 << 18, 8, 1000)):
        document = _with(("crypto", "kdfparams"), {"dklen": 32, "n": n, "r": r, "p": p, "salt": "00" * 32})
        with pytest.raises(KeystoreError) as caught:
            decrypt_keystore(document, "x")
        assert caught.value.reason == "unsupported_kdf"
    pbkdf2 = copy.deepcopy(DOCUMENT)
    pbkdf2["crypto"]["kdf"] = "pbkdf2"
    pbkdf2["crypto"]["kdfparams"] = {"dklen": 32, "c": 10**12, "prf": "hmac-sha256", "salt": "00" * 32}
    with pytest.raises(KeystoreError) as caught:
        decrypt_keystore(pbkdf2, "x")
    assert caught.value.reason == "unsupported_kdf"
    assert derivations == []


def test_address_field_must_match_the_key() -> None:
    other = WalletKey.generate()
    with pytest.raises(KeystoreError) as caught:
        decrypt_keystore(_with(("address",), other.address.raw.hex()), "correct horse")
    assert caught.value.reason == "address_mismatch"


@settings(max_examples=40)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_bytes_are_a_keystore_error(raw: bytes) -> None:
    with pytest.raises(KeystoreError):
        decrypt_keystore(parse_keystore_document(raw), "x")


def test_oversized_document_is_refused() -> None:
    with pytest.raises(KeystoreError):
        parse_keystore_document(b" " * (65 * 1024))
