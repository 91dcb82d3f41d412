"""The checkpoint manifest: round trip, id, signature and trainer checks, and hostile content."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crypto.digests import DIGEST_SIZE, blake3
from crypto.keys import WalletKey
from protocol.codec import decode, encode
from protocol.envelope import Domain, Envelope, seal
from protocol.errors import InvariantError, RemoteProtocolError
from protocol.manifest import (
    MAX_PATH_CHARS,
    MIN_PIECE_SIZE,
    FileEntry,
    Manifest,
    build_manifest,
    open_manifest,
    piece_count_for,
    piece_root,
    sign_manifest,
)
from tests.strategies.swarm import relative_paths

TRAINER = WalletKey(bytes(31) + b"\x07")
OTHER = WalletKey(bytes(31) + b"\x09")
NOW_MS = 1_700_000_000_000

paths = relative_paths


def manifest_for(files: list[tuple[str, int]], piece_size: int = MIN_PIECE_SIZE, step: int = 1) -> Manifest:
    total = sum(size for _, size in files)
    hashes = b"".join(blake3(i.to_bytes(8, "big")) for i in range(piece_count_for(total, piece_size)))
    return build_manifest(
        run="demo", step=step, piece_size=piece_size, files=files, piece_hashes=hashes, signer=TRAINER.address
    )


@st.composite
def file_lists(draw: st.DrawFn) -> list[tuple[str, int]]:
    names = draw(st.lists(paths, min_size=1, max_size=6, unique_by=str.casefold))
    # No name may be a directory of another ("a" and "a/b").
    folded = {n.casefold() for n in names}
    names = [n for n in names if not any(other.startswith(n.casefold() + "/") for other in folded)]
    sizes = draw(st.lists(st.integers(0, 5000), min_size=len(names), max_size=len(names)))
    files = list(zip(names, sizes, strict=True))
    if sum(sizes) == 0:
        files[0] = (files[0][0], 1)
    return files


@settings(max_examples=60, deadline=None)
@given(files=file_lists(), piece_exp=st.integers(10, 13), step=st.integers(0, 10**9))
def test_round_trip_and_id(files: list[tuple[str, int]], piece_exp: int, step: int) -> None:
    manifest = manifest_for(files, 1 << piece_exp, step)
    frame = encode(manifest)
    again = decode(frame, Manifest)
    assert again == manifest
    assert again.id() == manifest.id() == blake3(frame)
    assert sum(manifest.piece_length(i) for i in range(manifest.piece_count)) == manifest.total_size
    assert [f.path for f in manifest.files] == sorted(f.path for f in manifest.files)


def test_signed_manifest_is_accepted_only_from_the_trainer() -> None:
    manifest = manifest_for([("config.json", 100), ("model.safetensors", 5000)])
    envelope = sign_manifest(TRAINER, manifest, now_ms=NOW_MS)
    assert open_manifest(envelope, trainer=TRAINER.address, run="demo", expected_id=manifest.id()) == manifest
    with pytest.raises(RemoteProtocolError) as wrong:
        open_manifest(envelope, trainer=OTHER.address)
    assert wrong.value.reason == "wrong_signer"
    # A manifest naming the trainer but sealed by another key: the signature does not recover the claim.
    forged = Envelope(
        envelope.domain, envelope.payload, TRAINER.address, NOW_MS, envelope.nonce, b"\x00" * 65
    )
    with pytest.raises(RemoteProtocolError) as bad:
        open_manifest(forged, trainer=TRAINER.address)
    assert bad.value.reason in ("bad_signature", "signer_mismatch")
    other_manifest = dataclasses.replace(manifest, signer=OTHER.address)
    with pytest.raises(RemoteProtocolError) as by_other:
        open_manifest(sign_manifest(OTHER, other_manifest, now_ms=NOW_MS), trainer=TRAINER.address)
    assert by_other.value.reason == "wrong_signer"


def test_envelope_checks_domain_id_and_consistency() -> None:
    manifest = manifest_for([("config.json", 100)])
    envelope = sign_manifest(TRAINER, manifest, now_ms=NOW_MS)
    with pytest.raises(RemoteProtocolError) as other_run:
        open_manifest(envelope, trainer=TRAINER.address, run="another-run")
    assert other_run.value.reason == "wrong_domain"
    with pytest.raises(RemoteProtocolError) as other_id:
        open_manifest(envelope, trainer=TRAINER.address, expected_id=bytes(32))
    assert other_id.value.reason == "wrong_manifest_id"
    # Signed for the right run by the trainer, but the payload names another signer.
    mismatched = dataclasses.replace(manifest, signer=OTHER.address)
    sealed = seal(TRAINER, Domain("checkpoint", "demo"), encode(mismatched), now_ms=NOW_MS)
    with pytest.raises(RemoteProtocolError) as inconsistent:
        open_manifest(sealed, trainer=TRAINER.address)
    assert inconsistent.value.reason == "inconsistent_manifest"
    heartbeat = seal(TRAINER, Domain("heartbeat", "demo"), encode(manifest), now_ms=NOW_MS)
    with pytest.raises(RemoteProtocolError):
        open_manifest(heartbeat, trainer=TRAINER.address)


def test_signing_with_a_key_that_is_not_the_manifests_signer_is_refused() -> None:
    with pytest.raises(InvariantError):
        sign_manifest(OTHER, manifest_for([("config.json", 10)]), now_ms=NOW_MS)


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_any_tampering_with_the_signed_frame_is_refused(position: int, flip: int) -> None:
    manifest = manifest_for([("config.json", 100), ("model.safetensors", 3000)])
    frame = bytearray(encode(sign_manifest(TRAINER, manifest, now_ms=NOW_MS)))
    frame[position % len(frame)] ^= flip
    try:
        envelope = decode(bytes(frame), Envelope)
        opened = open_manifest(envelope, trainer=TRAINER.address, expected_id=manifest.id())
    except RemoteProtocolError:
        return
    # The only harmless flips are in the nonce or timestamp, which the signature covers: so none remain.
    raise AssertionError(f"tampered frame accepted: {opened}")


HOSTILE_PATHS = [
    "/etc/passwd",
    "../escape",
    "a/../../b",
    "a//b",
    "./config.json",
    "a/./b",
    "",
    "x" * (MAX_PATH_CHARS + 1),
    "dir/" + "y" * 129,
    "back\\slash",
    "nul\x00byte",
    "new\nline",
    "space name",
    "/".join(["d"] * 9),
    "ünïcode",
]


@pytest.mark.parametrize("path", HOSTILE_PATHS)
def test_hostile_paths_are_refused(path: str) -> None:
    with pytest.raises(InvariantError):
        FileEntry(path, 0, 10)


def _raw_manifest(**changes: object) -> dict[str, object]:
    manifest = manifest_for([("a.json", 3000), ("b.safetensors", 3000)])
    fields = {f.name: getattr(manifest, f.name) for f in dataclasses.fields(manifest)}
    fields.update(changes)
    return fields


def test_inconsistent_layouts_are_refused() -> None:
    good = manifest_for([("a.json", 3000), ("b.safetensors", 3000)])
    a, _ = good.files
    cases: dict[str, dict[str, object]] = {
        "gap": {"files": (a, FileEntry("b.safetensors", 3001, 2999))},
        "overlap": {"files": (a, FileEntry("b.safetensors", 2999, 3001))},
        "short": {"files": (a, FileEntry("b.safetensors", 3000, 2000))},
        "duplicate": {"files": (a, FileEntry("a.json", 3000, 3000))},
        "case duplicate": {"files": (a, FileEntry("A.json", 3000, 3000))},
        "unsorted": {"files": (FileEntry("b.safetensors", 0, 3000), FileEntry("a.json", 3000, 3000))},
        "file under file": {"files": (a, FileEntry("a.json/inner", 3000, 3000))},
        "no files": {"files": ()},
        "piece count": {"piece_hashes": good.piece_hashes + bytes(DIGEST_SIZE)},
        "ragged hashes": {"piece_hashes": good.piece_hashes[:-1]},
        "root": {"root": bytes(DIGEST_SIZE)},
        "piece size not a power of two": {"piece_size": 3000},
        "run name": {"run": "Bad Run"},
    }
    for name, change in cases.items():
        with pytest.raises(InvariantError):
            Manifest(**_raw_manifest(**change))  # type: ignore[arg-type]
            pytest.fail(f"{name} accepted")


def test_decoding_garbage_raises_only_remote_protocol_error() -> None:
    good = encode(manifest_for([("config.json", 5000)]))
    for cut in range(0, len(good), 7):
        with pytest.raises(RemoteProtocolError):
            decode(good[:cut], Manifest)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=400))
def test_random_bytes_never_escape_as_anything_else(data: bytes) -> None:
    with contextlib.suppress(RemoteProtocolError):  # anything else escaping fails the test
        decode(data, Manifest)


def test_root_is_independent_of_run_step_and_signer() -> None:
    one = manifest_for([("config.json", 5000)], step=1)
    two = dataclasses.replace(one, step=2)
    assert one.root == two.root == piece_root(one.piece_size, one.total_size, one.piece_hashes)
    assert one.id() != two.id()


def test_piece_validation() -> None:
    data = bytes(range(256)) * 20
    hashes = b"".join(blake3(data[i : i + MIN_PIECE_SIZE]) for i in range(0, len(data), MIN_PIECE_SIZE))
    manifest = build_manifest(
        run="demo",
        step=0,
        piece_size=MIN_PIECE_SIZE,
        files=[("w.safetensors", len(data))],
        piece_hashes=hashes,
        signer=TRAINER.address,
    )
    last = manifest.piece_count - 1
    assert manifest.piece_is_valid(0, data[:MIN_PIECE_SIZE])
    assert manifest.piece_is_valid(last, data[last * MIN_PIECE_SIZE :])
    assert not manifest.piece_is_valid(0, data[1 : MIN_PIECE_SIZE + 1])
    assert not manifest.piece_is_valid(last, data[last * MIN_PIECE_SIZE :] + b"\x00")
    with pytest.raises(IndexError):
        manifest.piece_span(manifest.piece_count)
