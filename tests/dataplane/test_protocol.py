"""The data plane's pure parts: the wallet-authenticated handshake and the MAC'd frame layer."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from crypto.digests import blake3
from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.dataplane import (
    FRAME_HEADER,
    HEAD_LENGTH,
    MAX_DIGESTED_HEAD,
    TAG_SIZE,
    DigestedFrame,
    Direction,
    FrameOpener,
    FrameSealer,
    is_digested,
)
from protocol.dataplane_handshake import (
    Auth,
    Handshake,
    Hello,
    Role,
    SessionKeys,
    dialer_auth_digest,
    transcript_hash,
)
from protocol.errors import LocalProtocolError, RemoteProtocolError


def _key(label: str) -> WalletKey:
    return WalletKey(hashlib.sha256(label.encode()).digest())


DIALER, LISTENER, STRANGER = _key("dialer"), _key("listener"), _key("stranger")
MAX_FRAME = 4096


def _machines(
    dialer: WalletKey = DIALER,
    listener: WalletKey = LISTENER,
    *,
    expected_by_dialer: WalletKey = LISTENER,
    expected_by_listener: WalletKey | None = None,
    listener_context: str = "swarm",
) -> tuple[Handshake, Handshake]:
    d = Handshake(
        Role.DIALER,
        dialer,
        ephemeral_secret=_key("eph-d").secret,
        nonce=b"\x01" * 32,
        context="swarm",
        expected_peer=expected_by_dialer.address,
    )
    lst = Handshake(
        Role.LISTENER,
        listener,
        ephemeral_secret=_key("eph-l").secret,
        nonce=b"\x02" * 32,
        context=listener_context,
        expected_peer=None if expected_by_listener is None else expected_by_listener.address,
    )
    return d, lst


def _transcript(d: Handshake, lst: Handshake) -> list[bytes]:
    """Run both machines to completion; the frames in wire order (d→l, l→d, l→d, d→l)."""
    frames: list[bytes] = []
    (hello_d,) = d.initial_frames()
    frames.append(hello_d)
    hello_l, auth_l = lst.receive(hello_d)
    frames += [hello_l, auth_l]
    assert d.receive(hello_l) == []
    (auth_d,) = d.receive(auth_l)
    frames.append(auth_d)
    assert lst.receive(auth_d) == []
    return frames


def test_handshake_authenticates_both_sides_and_agrees_on_keys() -> None:
    d, lst = _machines()
    _transcript(d, lst)
    assert d.done and lst.done and d.result and lst.result
    assert d.result.remote == LISTENER.address
    assert lst.result.remote == DIALER.address
    assert d.result.send_key == lst.result.receive_key != d.result.receive_key == lst.result.send_key
    assert d.result.send_direction is Direction.DIALER_TO_LISTENER is lst.result.receive_direction


def test_dialer_refuses_a_listener_with_another_wallet() -> None:
    d, lst = _machines(listener=STRANGER)
    (hello_d,) = d.initial_frames()
    hello_l, auth_l = lst.receive(hello_d)
    d.receive(hello_l)
    with pytest.raises(RemoteProtocolError) as caught:
        d.receive(auth_l)
    assert caught.value.reason == "wrong_peer"
    assert d.result is None
    with pytest.raises(LocalProtocolError):
        d.receive(auth_l)  # a failed handshake stays failed


def test_listener_with_an_expected_peer_refuses_anyone_else() -> None:
    d, lst = _machines(dialer=STRANGER, expected_by_listener=DIALER)
    (hello_d,) = d.initial_frames()
    hello_l, auth_l = lst.receive(hello_d)
    d.receive(hello_l)
    (auth_d,) = d.receive(auth_l)
    with pytest.raises(RemoteProtocolError) as caught:
        lst.receive(auth_d)
    assert caught.value.reason == "wrong_peer"


def test_a_different_context_fails_the_handshake() -> None:
    d, lst = _machines(listener_context="rollouts")
    (hello_d,) = d.initial_frames()
    hello_l, auth_l = lst.receive(hello_d)
    d.receive(hello_l)
    with pytest.raises(RemoteProtocolError) as caught:
        d.receive(auth_l)
    assert caught.value.reason == "bad_signature"


def test_a_claimed_address_without_its_signature_is_refused() -> None:
    d, lst = _machines()
    (hello_d,) = d.initial_frames()
    hello_l, auth_l = lst.receive(hello_d)
    d.receive(hello_l)
    d.receive(auth_l)  # the dialer's genuine auth is withheld; a forgery claiming its address is sent
    forged = Auth(DIALER.address, STRANGER.sign_digest(b"\x00" * 32))
    with pytest.raises(RemoteProtocolError) as caught:
        lst.receive(encode(forged))
    assert caught.value.reason == "bad_signature"


def test_a_relay_that_swaps_in_its_own_identity_gets_no_working_session() -> None:
    """Identity misbinding: a relay forwards the dialer's traffic but signs the final auth as itself. The
    listener then believes it talks to the relay, but its keys depend on the addresses, so no frame the
    real dialer sends is accepted."""
    d, lst = _machines()
    (hello_d,) = d.initial_frames()
    hello_l, auth_l = lst.receive(hello_d)
    d.receive(hello_l)
    d.receive(auth_l)
    transcript = transcript_hash("swarm", decode(hello_d, Hello), decode(hello_l, Hello))  # relay saw both
    relay_auth = Auth(
        STRANGER.address,
        STRANGER.sign_digest(dialer_auth_digest(transcript, LISTENER.address, STRANGER.address)),
    )
    lst.receive(encode(relay_auth))
    assert lst.result is not None and d.result is not None
    assert lst.result.remote == STRANGER.address
    frame = FrameSealer(d.result.send_key, d.result.send_direction).seal_wire(b"piece bytes")
    with pytest.raises(RemoteProtocolError) as caught:
        _opener(lst.result).open_wire(frame)
    assert caught.value.reason == "bad_mac"


@given(message_index=st.integers(0, 3), position=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_any_bit_flip_in_the_handshake_fails_it(message_index: int, position: int, bit: int) -> None:
    clean = _transcript(*_machines())
    d, lst = _machines()
    target = bytearray(clean[message_index])
    target[position % len(target)] ^= 1 << bit
    frames = list(clean)
    frames[message_index] = bytes(target)
    d.initial_frames()
    with pytest.raises(RemoteProtocolError):
        lst.receive(frames[0])
        d.receive(frames[1])
        d.receive(frames[2])
        lst.receive(frames[3])


def _pair(max_frame: int = MAX_FRAME) -> tuple[FrameSealer, FrameOpener]:
    key = _key("session").secret
    direction = Direction.DIALER_TO_LISTENER
    return FrameSealer(key, direction, max_frame=max_frame), FrameOpener(key, direction, max_frame=max_frame)


def _opener(keys: SessionKeys) -> FrameOpener:
    return FrameOpener(keys.receive_key, keys.receive_direction)


bodies = st.lists(st.binary(max_size=MAX_FRAME), min_size=1, max_size=5)


@given(bodies)
def test_frames_round_trip_in_order(sent: list[bytes]) -> None:
    sealer, opener = _pair()
    wire = [sealer.seal_wire(body) for body in sent]
    assert [len(w) for w in wire] == [FRAME_HEADER.size + len(b) + TAG_SIZE for b in sent]
    assert [opener.open_wire(w) for w in wire] == sent


@given(body=st.binary(max_size=256), position=st.integers(0, 10_000), bit=st.integers(0, 7))
@example(body=b"", position=0, bit=7)  # the digested flag on a plain frame (found by a CI-sized run)
def test_any_bit_flip_in_a_frame_is_rejected(body: bytes, position: int, bit: int) -> None:
    sealer, opener = _pair()
    wire = bytearray(sealer.seal_wire(body))
    wire[position % len(wire)] ^= 1 << bit
    with pytest.raises(RemoteProtocolError) as caught:
        opener.open_wire(bytes(wire))
    assert caught.value.reason in {"bad_mac", "truncated_frame", "frame_too_large"}
    with pytest.raises(LocalProtocolError):  # the connection is dead after one bad frame
        opener.open_wire(sealer.seal_wire(body))


@given(body=st.binary(max_size=256), data=st.data())
def test_any_truncation_is_rejected(body: bytes, data: st.DataObject) -> None:
    sealer, opener = _pair()
    wire = sealer.seal_wire(body)
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(RemoteProtocolError) as caught:
        opener.open_wire(wire[:cut])
    assert caught.value.reason == "truncated_frame"


@given(bodies)
def test_a_replayed_frame_is_rejected(sent: list[bytes]) -> None:
    sealer, opener = _pair()
    wire = [sealer.seal_wire(body) for body in sent]
    for w in wire:
        opener.open_wire(w)
    with pytest.raises(RemoteProtocolError) as caught:
        opener.open_wire(wire[-1])
    assert caught.value.reason == "bad_mac"


@given(st.lists(st.binary(max_size=64), min_size=2, max_size=5, unique=True), st.data())
def test_reordered_or_dropped_frames_are_rejected(sent: list[bytes], data: st.DataObject) -> None:
    sealer, opener = _pair()
    wire = [sealer.seal_wire(body) for body in sent]
    skip = data.draw(st.integers(1, len(wire) - 1))  # deliver frame `skip` in place of frame 0
    with pytest.raises(RemoteProtocolError) as caught:
        opener.open_wire(wire[skip])
    assert caught.value.reason == "bad_mac"


def test_a_frame_reflected_back_to_its_sender_is_rejected() -> None:
    d, lst = _machines()
    _transcript(d, lst)
    assert d.result is not None
    sealed = FrameSealer(d.result.send_key, d.result.send_direction).seal_wire(b"x")
    with pytest.raises(RemoteProtocolError):
        _opener(d.result).open_wire(sealed)


def test_oversized_lengths_are_refused_from_the_header_alone() -> None:
    _, opener = _pair()
    with pytest.raises(RemoteProtocolError) as caught:
        opener.body_length(FRAME_HEADER.pack(MAX_FRAME + 1))
    assert caught.value.reason == "frame_too_large"
    sealer, _ = _pair()
    with pytest.raises(LocalProtocolError):
        sealer.seal(bytes(MAX_FRAME + 1))
    at_cap = FrameOpener(b"k" * 32, Direction.DIALER_TO_LISTENER, max_frame=MAX_FRAME)
    assert at_cap.body_length(FRAME_HEADER.pack(MAX_FRAME)) == MAX_FRAME


def _open_any_wire(opener: FrameOpener, wire: bytes) -> bytes | DigestedFrame:
    """One whole frame as received, plain or digested (as the channel parses it)."""
    header = wire[: FRAME_HEADER.size]
    length = opener.body_length(header)
    if not is_digested(header):
        return opener.open_wire(wire)
    if len(wire) != FRAME_HEADER.size + length + TAG_SIZE or length < HEAD_LENGTH.size:
        opener.broken = True
        raise RemoteProtocolError("truncated", reason="truncated_frame")
    body = wire[FRAME_HEADER.size : FRAME_HEADER.size + length]
    head_end = HEAD_LENGTH.size + opener.head_length(length, body[: HEAD_LENGTH.size])
    head, bulk = body[HEAD_LENGTH.size : head_end], body[head_end:]
    return DigestedFrame(head, bulk, opener.open_digested(length, head, bulk, wire[-TAG_SIZE:]))


def _seal_digested_wire(sealer: FrameSealer, frame: DigestedFrame) -> bytes:
    start, tag = sealer.seal_digested(frame)
    return start + bytes(frame.bulk) + tag


mixed = st.lists(
    st.binary(max_size=300) | st.tuples(st.binary(max_size=60), st.binary(max_size=3000)),
    min_size=1,
    max_size=6,
)


@given(mixed, st.booleans())
def test_plain_and_digested_frames_round_trip_in_order(sent: list[object], claim: bool) -> None:
    """Digested frames share the counter with plain ones; each arrives with the digest of its bulk, whether
    the sender named it (a piece's manifest hash) or hashed the bulk itself."""
    sealer, opener = _pair()
    for item in sent:
        if isinstance(item, bytes):
            assert _open_any_wire(opener, sealer.seal_wire(item)) == item
        else:
            head, bulk = item  # type: ignore[misc]
            frame = DigestedFrame(head, bulk, blake3(bulk) if claim else None)
            assert _open_any_wire(opener, _seal_digested_wire(sealer, frame)) == DigestedFrame(
                head, bulk, blake3(bulk)
            )


@given(
    head=st.binary(max_size=60),
    bulk=st.binary(max_size=600),
    position=st.integers(0, 10_000),
    bit=st.integers(0, 7),
)
def test_any_bit_flip_in_a_digested_frame_is_rejected(
    head: bytes, bulk: bytes, position: int, bit: int
) -> None:
    """Including the flag bit: a digested frame read as a plain one (or the reverse) fails its MAC."""
    sealer, opener = _pair()
    wire = bytearray(_seal_digested_wire(sealer, DigestedFrame(head, bulk)))
    wire[position % len(wire)] ^= 1 << bit
    with pytest.raises(RemoteProtocolError) as caught:
        _open_any_wire(opener, bytes(wire))
    assert caught.value.reason in {"bad_mac", "truncated_frame", "frame_too_large", "bad_frame_head"}


def test_a_digested_frame_never_passes_for_a_plain_one_with_the_same_bytes() -> None:
    sealer, opener = _pair()
    start, tag = sealer.seal_digested(DigestedFrame(b"head", b"bulk"))
    body = start[FRAME_HEADER.size :] + b"bulk"
    with pytest.raises(RemoteProtocolError) as caught:
        opener.open_wire(FRAME_HEADER.pack(len(body)) + body + tag)
    assert caught.value.reason == "bad_mac"


def test_digested_frames_over_the_caps_are_refused_on_both_ends() -> None:
    sealer, _ = _pair(max_frame=1000)
    with pytest.raises(LocalProtocolError):
        sealer.seal_digested(DigestedFrame(b"", bytes(999)))
    with pytest.raises(LocalProtocolError):
        _pair()[0].seal_digested(DigestedFrame(bytes(MAX_DIGESTED_HEAD + 1), b""))
    _, opener = _pair()
    with pytest.raises(RemoteProtocolError) as caught:
        opener.head_length(100, HEAD_LENGTH.pack(99))  # head and its length field longer than the frame
    assert caught.value.reason == "bad_frame_head"
