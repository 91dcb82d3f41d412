"""The libp2p peer ID of a wallet key equals py-libp2p's own computation, and maps back to the address."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crypto.errors import CryptoError
from crypto.identity import (
    address_from_peer_id,
    base58_decode,
    base58_encode,
    peer_id_from_public_key,
    public_key_from_peer_id,
)
from crypto.keys import SECP256K1_ORDER, WalletKey

keys = st.integers(1, SECP256K1_ORDER - 1).map(lambda n: WalletKey(n.to_bytes(32, "big")))


@given(keys)
def test_peer_id_matches_libp2p(key: WalletKey) -> None:
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.id import ID

    expected = ID.from_pubkey(create_new_key_pair(key.secret).public_key).to_base58()
    assert peer_id_from_public_key(key.public_key) == expected
    assert expected.startswith("16Uiu2")


@given(keys)
def test_peer_id_maps_back_to_the_address(key: WalletKey) -> None:
    peer_id = peer_id_from_public_key(key.public_key)
    assert public_key_from_peer_id(peer_id) == key.public_key
    assert address_from_peer_id(peer_id) == key.address


@given(st.binary(max_size=64))
def test_base58_round_trip(data: bytes) -> None:
    assert base58_decode(base58_encode(data)) == data


def test_ed25519_peer_id_is_not_a_wallet() -> None:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.id import ID

    ed_peer = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    with pytest.raises(CryptoError):
        address_from_peer_id(ed_peer)


@given(st.text(max_size=140))
def test_arbitrary_text_fails_only_with_crypto_error(text: str) -> None:
    with contextlib.suppress(CryptoError):
        address_from_peer_id(text)


def test_decoded_peer_ids_are_cached_within_a_bound_and_failures_are_not() -> None:
    from crypto.identity import _decode_peer_id

    key = WalletKey(bytes(31) + b"\x07")
    peer_id = peer_id_from_public_key(key.public_key)
    for _ in range(2):  # a refused peer ID is refused every time, not remembered as anything
        with pytest.raises(CryptoError):
            address_from_peer_id(peer_id[:-1] + "0")
    assert address_from_peer_id(peer_id) == key.address
    hits = _decode_peer_id.cache_info().hits
    assert address_from_peer_id(peer_id) == key.address
    assert public_key_from_peer_id(peer_id) == key.public_key
    assert _decode_peer_id.cache_info().hits == hits + 2
    assert _decode_peer_id.cache_info().maxsize == 4096
