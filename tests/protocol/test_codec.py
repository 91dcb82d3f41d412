"""Codec properties for every registered message type: round trip, canonical form, hostile input."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import Message, decode, decode_any, encode
from protocol.errors import LocalProtocolError, RemoteProtocolError
from tests.protocol.message_types import ALL_TYPES, Everything, Inner
from tests.strategies.messages import message_strategy

TYPE_IDS = [name for name, _ in ALL_TYPES]


@pytest.mark.parametrize(("name", "cls"), ALL_TYPES, ids=TYPE_IDS)
@given(data=st.data())
def test_round_trip_truncation_and_bit_flip(name: str, cls: type[Message], data: st.DataObject) -> None:
    """Three properties of every drawn message, checked on one draw (drawing a message costs more than
    checking it, so one test per property drew each example three times)."""
    original = data.draw(message_strategy(cls))
    frame = encode(original)
    # Encode then decode is the identity, and the encoding is canonical.
    assert decode(frame, cls) == original
    assert decode_any(frame) == original
    assert encode(decode(frame, cls)) == frame
    # Every truncation is a remote error.
    for cut in range(len(frame)):
        with pytest.raises(RemoteProtocolError):
            decode(frame[:cut], cls)
    # A bit flip never decodes to the same message.
    bit = data.draw(st.integers(0, len(frame) * 8 - 1))
    flipped = bytearray(frame)
    flipped[bit // 8] ^= 1 << (bit % 8)
    with contextlib.suppress(RemoteProtocolError):
        # Compared by canonical bytes: a flip of a float's sign bit turns 0.0 into -0.0, a different
        # message that == cannot tell from the original.
        assert encode(decode_any(bytes(flipped))) != frame


@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_remote_errors(raw: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):
        decode_any(raw)


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@given(version=values, type_name=st.sampled_from(TYPE_IDS) | values, body=values)
def test_structured_garbage_raises_only_remote_errors(
    version: object, type_name: object, body: object
) -> None:
    """Well-formed msgpack with the right outline but wrong contents must still be refused cleanly."""
    with contextlib.suppress(RemoteProtocolError):
        decode_any(msgpack.packb([version, type_name, body], use_bin_type=True))


def _everything(**changes: object) -> Everything:
    fields: dict[str, object] = {
        "flag": True,
        "count": 3,
        "big": -5,
        "blob": b"x",
        "name": "n",
        "maybe": None,
        "digest": b"abcd",
        "items": (Inner("a", 1.5, None),),
        "numbers": (1, 2),
        "nested": Inner("b", 0.0, None),
    }
    fields.update(changes)
    return Everything(**fields)  # type: ignore[arg-type]


def test_non_canonical_encoding_is_refused() -> None:
    frame = encode(_everything())
    body = msgpack.unpackb(frame, raw=False)
    # The same values, with `count` (3) written as a 2-byte int instead of a fixint.
    packer = msgpack.Packer(use_bin_type=True)
    head = packer.pack(body[0]) + packer.pack(body[1])
    fields = body[2]
    encoded_fields = b"".join((b"\xcd\x00\x03" if i == 1 else packer.pack(v)) for i, v in enumerate(fields))
    wide = b"\x93" + head + bytes([0x90 + len(fields)]) + encoded_fields
    assert msgpack.unpackb(wide, raw=False) == body
    with pytest.raises(RemoteProtocolError) as caught:
        decode(wide, Everything)
    assert caught.value.reason == "non_canonical"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"count": 1001}, "malformed"),
        ({"blob": b"x" * 257}, "malformed"),
        ({"items": (Inner("a", 1.0, None),) * 9}, "malformed"),
        ({"digest": b"abc"}, "malformed"),
    ],
)
def test_encoding_out_of_bounds_is_a_local_error(change: dict[str, object], reason: str) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        encode(_everything(**change))
    assert caught.value.reason == reason


def test_wrong_field_type_from_the_wire_is_refused() -> None:
    frame = msgpack.unpackb(encode(_everything()), raw=False)
    frame[2][4] = b"bytes where a str belongs"
    with pytest.raises(RemoteProtocolError):
        decode(msgpack.packb(frame, use_bin_type=True), Everything)


def test_size_cap_is_checked_before_parsing() -> None:
    with pytest.raises(RemoteProtocolError) as caught:
        decode(b"\x93" + b"\0" * (Inner.MAX_BYTES + 1), Inner)
    assert caught.value.reason == "too_large"


def test_wrong_type_and_unknown_version() -> None:
    frame = encode(Inner("a", 1.0, None))
    with pytest.raises(RemoteProtocolError) as caught:
        decode(frame, Everything)
    assert caught.value.reason == "wrong_type"
    unpacked = msgpack.unpackb(frame, raw=False)
    unpacked[0] = 99
    with pytest.raises(RemoteProtocolError) as caught:
        decode_any(msgpack.packb(unpacked, use_bin_type=True))
    assert caught.value.reason == "bad_version"


def test_unregistered_and_nan_are_local_errors() -> None:
    with pytest.raises(LocalProtocolError):
        encode(Message())
    with pytest.raises(LocalProtocolError):
        encode(Inner("a", float("nan"), None))
