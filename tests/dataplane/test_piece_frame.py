"""The piece frame's own encoder/decoders (protocol/dataplane.py) against the general codec: the same bytes
out (a digested frame's head and data joined), and a frame is taken only if the codec would read it as that
very piece."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import decode_any, encode
from protocol.dataplane import DigestedFrame
from protocol.errors import LocalProtocolError
from protocol.manifest import MAX_PIECE_SIZE, MAX_PIECES
from protocol.piece_frames import (
    decode_digested_piece,
    decode_indexed,
    decode_piece,
    encode_indexed,
    piece_frame,
)
from protocol.swarm.messages import Cancel, Have, Piece, Request

manifest_ids = st.binary(min_size=32, max_size=32)
indices = st.integers(0, MAX_PIECES - 1) | st.sampled_from([0, 127, 128, 255, 256, 65535, 65536])
bodies = st.binary(max_size=600) | st.integers(0, 70_000).map(bytes)


@given(manifest_ids, indices, bodies)
def test_encoding_a_piece_gives_the_codecs_bytes_and_reads_back(mid: bytes, index: int, data: bytes) -> None:
    digested = piece_frame(mid, index, data, None)
    frame = digested.joined()
    assert frame == encode(Piece(mid, index, data))
    assert decode_piece(frame) == Piece(mid, index, data) == decode_any(frame)
    assert decode_digested_piece(digested) == Piece(mid, index, data)
    assert digested.bulk is data  # the data goes out from its own buffer, never copied into a frame


@given(manifest_ids, indices, st.binary(max_size=300), st.integers(-8, 8))
def test_a_digested_frame_split_anywhere_else_is_left_to_the_codec(
    mid: bytes, index: int, data: bytes, shift: int
) -> None:
    """Only the canonical head with exactly its data is a digested piece; a head that also holds data bytes
    (or lacks some of its own) is decoded from the joined bytes, where the bulk's digest means nothing."""
    frame = encode(Piece(mid, index, data))
    split = len(piece_frame(mid, index, data, None).head) + shift
    if not 0 <= split <= len(frame):
        return
    moved = DigestedFrame(frame[:split], frame[split:])
    assert (decode_digested_piece(moved) is not None) == (shift == 0)


@given(manifest_ids, indices, st.binary(max_size=300), st.data())
def test_a_changed_frame_is_taken_only_as_the_codec_reads_it(
    mid: bytes, index: int, data: bytes, draw: st.DataObject
) -> None:
    frame = bytearray(encode(Piece(mid, index, data)))
    for _ in range(draw.draw(st.integers(1, 3))):
        action = draw.draw(st.sampled_from(["flip", "cut", "add"]))
        position = draw.draw(st.integers(0, len(frame)))
        if action == "flip" and position < len(frame):
            frame[position] ^= draw.draw(st.integers(1, 255))
        elif action == "cut":
            del frame[position : position + draw.draw(st.integers(1, 4))]
        else:
            frame[position:position] = draw.draw(st.binary(min_size=1, max_size=4))
    fast = decode_piece(bytes(frame))
    if fast is None:
        return
    assert fast == decode_any(bytes(frame))


@pytest.mark.parametrize(
    "frame",
    [
        encode(Have(bytes(32), 3)),
        b"",
        encode(Piece(bytes(32), 200, b"x"))[:-1],
        encode(Piece(bytes(32), 200, b"x")) + b"y",
        encode(Piece(bytes(32), 5, b"x")).replace(b"\x05\xc4", b"\xcc\x05\xc4"),  # index not in shortest form
    ],
)
def test_frames_that_are_not_a_canonical_piece_are_left_to_the_codec(frame: bytes) -> None:
    assert decode_piece(frame) is None


def test_fields_out_of_bounds_are_refused_as_the_codec_refuses_them() -> None:
    with pytest.raises(LocalProtocolError):
        piece_frame(bytes(31), 0, b"x", None)
    with pytest.raises(LocalProtocolError):
        piece_frame(bytes(32), MAX_PIECES, b"x", None)
    with pytest.raises(LocalProtocolError):
        piece_frame(bytes(32), 0, bytes(MAX_PIECE_SIZE + 1), None)


indexed_kinds = st.sampled_from([Have, Request, Cancel])


@given(indexed_kinds, manifest_ids, indices)
def test_have_request_and_cancel_encode_as_the_codec_and_read_back(
    kind: type[Have] | type[Request] | type[Cancel], mid: bytes, index: int
) -> None:
    message = kind(mid, index)
    frame = encode_indexed(message)
    assert frame == encode(message)
    assert decode_indexed(frame) == message == decode_any(frame)
    assert decode_piece(frame) is None and decode_indexed(encode(Piece(mid, index, b"x"))) is None


@given(indexed_kinds, manifest_ids, indices, st.data())
def test_a_changed_indexed_frame_is_taken_only_as_the_codec_reads_it(
    kind: type[Have] | type[Request] | type[Cancel], mid: bytes, index: int, draw: st.DataObject
) -> None:
    frame = bytearray(encode(kind(mid, index)))
    for _ in range(draw.draw(st.integers(1, 3))):
        action = draw.draw(st.sampled_from(["flip", "cut", "add"]))
        position = draw.draw(st.integers(0, len(frame)))
        if action == "flip" and position < len(frame):
            frame[position] ^= draw.draw(st.integers(1, 255))
        elif action == "cut":
            del frame[position : position + draw.draw(st.integers(1, 4))]
        else:
            frame[position:position] = draw.draw(st.binary(min_size=1, max_size=4))
    fast = decode_indexed(bytes(frame))
    if fast is None:
        return
    assert fast == decode_any(bytes(frame))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x93\x01",
        encode(Have(bytes(32), 3))[:-1],
        encode(Have(bytes(32), 3)) + b"y",
        encode(Have(bytes(32), 5)).replace(b"\x05", b"\xcc\x05"),  # index not in shortest form
        encode(Have(bytes(32), 300)).replace(b"\xcd\x01\x2c", b"\xce\x00\x00\x01\x2c"),
        encode(Have(bytes(32), 3)).replace(b"\x03", b"\xff"),  # a negative index
        encode(Have(bytes(32), 3)).replace(b"swarm.have", b"swarm.hav3"),
    ],
)
def test_frames_that_are_not_a_canonical_have_request_or_cancel_are_left_to_the_codec(frame: bytes) -> None:
    assert decode_indexed(frame) is None


def test_indexed_fields_out_of_bounds_are_refused_as_the_codec_refuses_them() -> None:
    with pytest.raises(LocalProtocolError):
        encode_indexed(Have(bytes(31), 0))
    with pytest.raises(LocalProtocolError):
        encode_indexed(Request(bytes(32), MAX_PIECES))
    frame = encode(Have(bytes(32), 0))[:-1] + b"\xce" + MAX_PIECES.to_bytes(4, "big")
    assert decode_indexed(frame) is None
