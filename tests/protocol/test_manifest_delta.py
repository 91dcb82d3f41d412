"""Delta manifests (protocol/manifest.py): ``base`` and ``target`` name the full versions a delta turns one
into the other; both empty (a full version) or both 32-byte ids that differ, over exactly one
``weights.delta`` file. Anything else is refused at decode time."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.digests import DIGEST_SIZE, blake3
from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.manifest import (
    DELTA_FILE_NAME,
    MIN_PIECE_SIZE,
    Manifest,
    build_manifest,
    open_manifest,
    piece_count_for,
    sign_manifest,
)
from tests.strategies.swarm import delta_manifests, manifests

TRAINER = WalletKey(bytes(31) + b"\x07")
NOW_MS = 1_700_000_000_000
BASE, TARGET = blake3(b"base"), blake3(b"target")


def delta(
    *,
    base: bytes = BASE,
    target: bytes = TARGET,
    files: tuple[tuple[str, int], ...] = ((DELTA_FILE_NAME, 5000),),
) -> Manifest:
    total = sum(size for _, size in files)
    hashes = b"".join(blake3(bytes([i])) for i in range(piece_count_for(total, MIN_PIECE_SIZE)))
    return build_manifest(
        run="demo",
        step=3,
        piece_size=MIN_PIECE_SIZE,
        files=list(files),
        piece_hashes=hashes,
        signer=TRAINER.address,
        base=base,
        target=target,
    )


@settings(max_examples=80, deadline=None)
@given(manifest=st.one_of(manifests(), delta_manifests()))
def test_full_and_delta_manifests_round_trip_and_keep_their_kind(manifest: Manifest) -> None:
    frame = encode(manifest)
    back = decode(frame, Manifest)
    assert back == manifest
    assert back.id() == blake3(frame)
    assert back.is_delta == bool(manifest.base)
    assert len(back.base) == len(back.target) == (DIGEST_SIZE if back.is_delta else 0)


def test_a_full_manifest_built_as_before_has_empty_base_and_target() -> None:
    full = delta(base=b"", target=b"", files=(("config.json", 10), ("model.safetensors", 3000)))
    assert (full.base, full.target, full.is_delta) == (b"", b"", False)


def test_a_signed_delta_opens_for_the_trainer() -> None:
    manifest = delta()
    envelope = sign_manifest(TRAINER, manifest, now_ms=NOW_MS)
    opened = open_manifest(envelope, trainer=TRAINER.address, run="demo", expected_id=manifest.id())
    assert opened.is_delta and (opened.base, opened.target) == (BASE, TARGET)


@pytest.mark.parametrize(
    ("base", "target"),
    [
        (BASE, b""),
        (b"", TARGET),
        (BASE[:31], TARGET),
        (BASE, TARGET[:5]),
        (BASE, BASE),
    ],
)
def test_half_named_short_or_self_referencing_deltas_are_refused(base: bytes, target: bytes) -> None:
    with pytest.raises(InvariantError) as caught:
        delta(base=base, target=target)
    assert caught.value.reason == "bad_manifest"


@pytest.mark.parametrize(
    "files",
    [
        (("config.json", 100),),
        ((DELTA_FILE_NAME, 100), ("zz.bin", 100)),
        (("a", 10), (DELTA_FILE_NAME, 100)),
    ],
)
def test_a_delta_must_hold_exactly_the_one_delta_file(files: tuple[tuple[str, int], ...]) -> None:
    with pytest.raises(InvariantError):
        delta(files=files)


@settings(max_examples=40, deadline=None)
@given(
    manifest=delta_manifests(),
    which=st.sampled_from(["base", "target"]),
    value=st.one_of(st.binary(max_size=DIGEST_SIZE - 1), st.just(b"")),
)
def test_hostile_delta_fields_on_the_wire_are_remote_protocol_errors(
    manifest: Manifest, which: str, value: bytes
) -> None:
    """Re-encode a valid delta with one field broken (bypassing the constructor, as a peer could)."""
    version, kind, body = msgpack.unpackb(encode(manifest), raw=False)
    names = [field.name for field in dataclasses.fields(Manifest)]
    body[names.index(which)] = value
    with pytest.raises(RemoteProtocolError):
        decode(msgpack.packb([version, kind, body], use_bin_type=True), Manifest)
    # A base equal to the target is refused too.
    body[names.index("base")] = body[names.index("target")] = manifest.target
    with pytest.raises(RemoteProtocolError):
        decode(msgpack.packb([version, kind, body], use_bin_type=True), Manifest)
