"""``doctor --run RUN@0xTRAINER,BOOTSTRAP``: learn the run's config and its model from the swarm, as
``join`` does, so the role check sizes the run's actual model in the run's dtypes.

1. The run announcement: asked of each bootstrap peer over ``/prime-node/run/1`` (what ``RunFollower``
   asks), believed only when the pinned trainer signed it (``TrainerTrust``), turned into the worker's
   ``RunConfig`` by ``worker_run_config`` (a task file missing here is the same finding ``join`` stops on;
   the role is still sized without it).
2. The newest checkpoint: a data-plane channel to the same peer (over the libp2p fallback stream, so no
   data-plane port is needed), the versions it offers, the newest one's manifest (checked against the
   pinned trainer; a delta leads to its full target). Its files give the checkpoint's size.
3. The model's shape: the pieces holding ``config.json`` and each safetensors header are requested and
   checked against the manifest's piece hashes, then read by the same ``model_shape`` ``join`` reads on
   the complete checkpoint: exact. A peer that does not serve those pieces in time (the trainer
   super-seeds: it reveals only a few pieces to each peer) leaves the shape unknown; the parameter count
   then comes from the safetensors file sizes in the run's publish dtype (exact but for the headers) and
   the KV cache is not counted, which the report says.
Every step has a timeout; whatever goes wrong is a fact with its reason, never an exception.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from crypto.digests import blake3
from crypto.errors import CryptoError
from crypto.identity import address_from_peer_id
from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.config.run import validate_run_config
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import AuthenticatedChannel
from prime_node.dataplane.connect import dial_channel
from prime_node.dataplane.libp2p_stream import P2PStream, RouteStats, fallback_protocol
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from prime_node.roles.announcement import (
    LOCAL_FIELDS,
    MAX_FRAME,
    RUN_PROTOCOL,
    TASK_DIGEST,
    worker_run_config,
)
from prime_node.swarm.transfer import decode_frame
from prime_node.swarm.versions import open_sent
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.manifest import Manifest
from protocol.run_announcement import RunAnnouncement, TrainerTrust, config_of
from protocol.swarm.messages import Bitfield, Have, ManifestEnvelope, ManifestRequest, Offer, Piece, Request
from protocol.swarm.pieceset import from_wire, to_wire

log = logging.getLogger(__name__)
OFFERS_QUIET_S: Final = 0.5
"""A peer sends its offers as soon as the channel is up: once none came for this long, that was all."""
MAX_CONFIG_JSON: Final = 1 << 20
MAX_HEADER: Final = 16 << 20
MAX_SHAPE_PIECES: Final = 64
"""At most this many pieces are fetched for config.json and the headers (a checkpoint of 1,000 shards
with tiny pieces is sized from its file sizes instead)."""
DTYPE_BYTES: Final = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class RunModel:
    """What the swarm told about the run: its config and its newest checkpoint's model."""

    run_id: str
    trainer: Address
    config: RunConfig | None = None
    join_error: str | None = None
    """Why ``join`` would stop on this run here (a task file missing), if it would."""
    step: int | None = None
    checkpoint_bytes: int | None = None
    shape: Any = None
    """``prime_node.ml.vram_plan.ModelShape``; None when only the file sizes are known."""
    params_from_sizes: int | None = None
    error: str | None = None
    """Why the run could not be learnt (no announcement, no checkpoint): the role is then not sized."""
    peer: str | None = None


class _LearnError(Exception):
    """A step of learning the run failed (its message says why)."""


async def learn_run(
    bootstrap: list[str], run_id: str, trainer: Address, data_dir: Path, listen: str, timeout: float
) -> RunModel:
    """The run's config and model from the first bootstrap peer that has them (see the module doc)."""
    errors: list[str] = []
    for multiaddr in bootstrap:
        try:
            key = WalletKey.generate()  # the data plane's channel must prove the libp2p host's key
            async with open_libp2p_host(key, listen) as host:
                with trio.fail_after(timeout):
                    peer_id = await host.connect(multiaddr)
                return await _learn_from(host, key, peer_id, run_id, trainer, data_dir, timeout)
        except (NodeError, _LearnError) as exc:
            errors.append(f"{multiaddr[-16:]}: {exc}")
        except trio.TooSlowError:
            errors.append(f"{multiaddr[-16:]}: no answer within {timeout:.0f} s")
    why = "; ".join(errors) if errors else "no bootstrap peer given"
    return RunModel(run_id, trainer, error=why[:600])


async def _learn_from(
    host: Libp2pHost,
    key: WalletKey,
    peer_id: str,
    run_id: str,
    trainer: Address,
    data_dir: Path,
    timeout: float,
) -> RunModel:
    announcement = await _announcement(host, peer_id, run_id, trainer, timeout)
    config, join_error = await trio.to_thread.run_sync(_worker_config, announcement, data_dir)
    found = RunModel(run_id, trainer, config=config, join_error=join_error, peer=peer_id)
    try:
        address = address_from_peer_id(peer_id)
    except CryptoError as exc:
        return dataclasses.replace(found, error=f"peer {peer_id} has no wallet key: {exc}")
    try:
        return await _checkpoint(host, key, peer_id, address, found, timeout)
    except (NodeError, ProtocolError, _LearnError) as exc:
        return dataclasses.replace(found, error=f"no checkpoint of the run from {peer_id[-8:]}: {exc}")
    except trio.TooSlowError:
        return dataclasses.replace(
            found, error=f"no checkpoint of the run from {peer_id[-8:]} within {timeout:.0f} s"
        )


async def _announcement(
    host: Libp2pHost, peer_id: str, run_id: str, trainer: Address, timeout: float
) -> RunAnnouncement:
    with trio.fail_after(timeout):
        stream = await host.open_stream(peer_id, RUN_PROTOCOL)
        try:
            frame = await stream.receive_frame(MAX_FRAME)
        finally:
            await stream.close()
    if frame is None:
        raise _LearnError(f"the peer holds no announcement of run {run_id} (is it in the run?)")
    try:
        return TrainerTrust(run_id, pinned=trainer).offer(
            decode(frame, Envelope), now_ms=NodeClock().wall_ms()
        )
    except ProtocolError as exc:
        raise _LearnError(f"its run announcement is refused: {exc}") from None


def _worker_config(announcement: RunAnnouncement, data_dir: Path) -> tuple[RunConfig, str | None]:
    """The RunConfig ``join`` would build here, and why ``join`` would stop on it (if it would); the
    config then comes without its task file, which sizing does not need. Blocking (hashes a file)."""
    try:
        return worker_run_config(announcement, task_dir=data_dir / "tasks"), None
    except NodeError as exc:
        if exc.reason != "task_file":
            raise
        data = config_of(announcement)
        for name in (*LOCAL_FIELDS, TASK_DIGEST):
            data.pop(name, None)
        if isinstance(data.get("task"), dict):
            data["task"]["path"] = None
        data["trainer_address"] = str(announcement.trainer)
        return validate_run_config(data, source=f"run {announcement.run_id}'s announced config"), str(exc)


async def _checkpoint(
    host: Libp2pHost, key: WalletKey, peer_id: str, address: Address, found: RunModel, timeout: float
) -> RunModel:
    framed = await host.open_stream(peer_id, fallback_protocol("swarm"))
    with trio.fail_after(timeout):
        channel = await dial_channel(
            P2PStream(framed.raw, RouteStats()),
            key,
            expected_peer=address,
            budget=MemoryBudget(64 << 20),
        )
    try:
        with trio.fail_after(timeout):
            offers = await _offers(channel)
            mid, manifest = await _newest_full(channel, offers, found.trainer)
        checkpoint = dataclasses.replace(found, step=manifest.step, checkpoint_bytes=manifest.total_size)
        assert found.config is not None
        dtype = DTYPE_BYTES.get(found.config.published_dtype, 2)
        checkpoint = dataclasses.replace(checkpoint, params_from_sizes=_params_from_sizes(manifest, dtype))
        try:
            with trio.fail_after(timeout):
                pieces = await _pieces(channel, mid, manifest)
            shape = await trio.to_thread.run_sync(_shape_from_pieces, manifest, pieces)
        except (NodeError, ProtocolError, _LearnError, trio.TooSlowError) as exc:
            log.info("the model's shape stays unknown: %s", exc or "its pieces were not served in time")
            return checkpoint
        return dataclasses.replace(checkpoint, shape=shape)
    finally:
        await channel.aclose()


async def _receive(channel: AuthenticatedChannel) -> Any:
    message, _ = decode_frame(await channel.receive(), max(Piece.MAX_BYTES, ManifestEnvelope.MAX_BYTES))
    return message


async def _offers(channel: AuthenticatedChannel) -> dict[bytes, int]:
    offers: dict[bytes, int] = {}
    while True:
        with trio.move_on_after(OFFERS_QUIET_S if offers else 10 * OFFERS_QUIET_S):
            message = await _receive(channel)
            if isinstance(message, Offer):
                offers[message.manifest_id] = message.step
            continue
        if not offers:
            raise _LearnError("the peer offers no checkpoint of the run yet")
        return offers


async def _manifest(channel: AuthenticatedChannel, mid: bytes, trainer: Address) -> Manifest:
    await channel.send_frame(encode(ManifestRequest(mid)))
    while True:
        message = await _receive(channel)
        if isinstance(message, ManifestEnvelope) and message.manifest_id == mid:
            return open_sent(message, trainer)[1]


async def _newest_full(
    channel: AuthenticatedChannel, offers: dict[bytes, int], trainer: Address
) -> tuple[bytes, Manifest]:
    """The newest offered version's full manifest (a delta's target), signed by the trainer."""
    mid = max(offers, key=lambda m: offers[m])
    manifest = await _manifest(channel, mid, trainer)
    if manifest.is_delta:
        mid = manifest.target
        manifest = await _manifest(channel, mid, trainer)
    return mid, manifest


def _params_from_sizes(manifest: Manifest, dtype_bytes: int) -> int:
    """The weights' bytes over the published dtype's (the headers, a few KiB, counted as weights)."""
    weights = sum(f.size for f in manifest.files if f.path.endswith(".safetensors"))
    return weights // dtype_bytes


def _needed_pieces(manifest: Manifest, header_lengths: dict[str, int]) -> set[int]:
    """Pieces holding config.json, each safetensors file's length prefix and (once known) its header."""
    ranges: list[tuple[int, int]] = []
    for entry in manifest.files:
        if entry.path == "config.json" and entry.size <= MAX_CONFIG_JSON:
            ranges.append((entry.offset, entry.size))
        elif entry.path.endswith(".safetensors") and "/" not in entry.path and entry.size >= 8:
            ranges.append((entry.offset, 8 + min(header_lengths.get(entry.path, 0), entry.size - 8)))
    size = manifest.piece_size
    return {i for start, length in ranges for i in range(start // size, (start + length - 1) // size + 1)}


async def _pieces(channel: AuthenticatedChannel, mid: bytes, manifest: Manifest) -> dict[int, bytes]:
    """The pieces ``_shape_from_pieces`` needs, each checked against its hash (a session like a fetch's:
    offer the version, an empty bitfield, then requests for pieces the peer has)."""
    await channel.send_frame(encode(Offer(mid, manifest.step)))
    await channel.send_frame(encode(Bitfield(mid, to_wire(0, manifest.piece_count))))
    held = 0
    got: dict[int, bytes] = {}
    asked: set[int] = set()
    headers: dict[str, int] = {}
    while True:
        wanted = _needed_pieces(manifest, headers)
        if len(wanted) > MAX_SHAPE_PIECES:
            raise _LearnError(f"{len(wanted)} pieces hold the model's shape")
        if wanted <= got.keys():
            lengths = _header_lengths(manifest, got)
            if lengths == headers:
                return got
            headers = lengths
            continue
        for index in sorted((wanted - asked) & set(_members(held))):
            asked.add(index)
            await channel.send_frame(encode(Request(mid, index)))
        message = await _receive(channel)
        if getattr(message, "manifest_id", None) != mid:
            continue
        if isinstance(message, Bitfield):
            held |= from_wire(message.bits, manifest.piece_count)
        elif isinstance(message, Have):
            held |= 1 << message.index
        elif isinstance(message, Piece) and message.index in asked:
            if blake3(message.data) != manifest.piece_hash(message.index):
                raise _LearnError(f"piece {message.index} does not match the manifest")
            got[message.index] = message.data


def _members(bits: int) -> list[int]:
    return [i for i in range(bits.bit_length()) if bits >> i & 1]


def _read(manifest: Manifest, pieces: dict[int, bytes], start: int, length: int) -> bytes | None:
    size = manifest.piece_size
    out = bytearray()
    for index in range(start // size, (start + length - 1) // size + 1):
        if index not in pieces:
            return None
        out += pieces[index]
    first = (start // size) * size
    return bytes(out[start - first : start - first + length])


def _header_lengths(manifest: Manifest, pieces: dict[int, bytes]) -> dict[str, int]:
    lengths = {}
    for entry in manifest.files:
        if entry.path.endswith(".safetensors") and "/" not in entry.path and entry.size >= 8:
            prefix = _read(manifest, pieces, entry.offset, 8)
            if prefix is not None:
                (length,) = struct.unpack("<Q", prefix)
                if length > MAX_HEADER:
                    raise _LearnError(f"{entry.path} has a {length}-byte header")
                lengths[entry.path] = length
    return lengths


def _shape_from_pieces(manifest: Manifest, pieces: dict[int, bytes]) -> Any:
    """The ``ModelShape`` ``join`` reads, from config.json and the safetensors headers written into a
    scratch directory (each header file holds only its 8-byte prefix and header: no weight)."""
    from prime_node.ml.vram_plan import model_shape

    with tempfile.TemporaryDirectory(prefix="prime-node-doctor-") as scratch:
        directory = Path(scratch)
        for entry in manifest.files:
            if entry.path == "config.json":
                data = _read(manifest, pieces, entry.offset, entry.size)
            elif entry.path.endswith(".safetensors") and "/" not in entry.path and entry.size >= 8:
                prefix = _read(manifest, pieces, entry.offset, 8)
                length = struct.unpack("<Q", prefix)[0] if prefix is not None else 0
                data = _read(manifest, pieces, entry.offset, 8 + length)
            else:
                continue
            if data is None:
                raise _LearnError(f"{entry.path} was not served")
            (directory / entry.path).write_bytes(data)
        if not (directory / "config.json").is_file():
            raise _LearnError("the checkpoint has no config.json")
        return model_shape(directory)


def json_facts(model: RunModel) -> dict[str, Any]:
    """The facts for the report's JSON."""
    shape = model.shape
    return {
        "run": f"{model.run_id}@{model.trainer}",
        "step": model.step,
        "checkpoint_bytes": model.checkpoint_bytes,
        "params": shape.params if shape is not None else model.params_from_sizes,
        "shape_exact": shape is not None,
        "inference_dtype": model.config.inference_dtype if model.config is not None else None,
        "inferer_devices": list(model.config.inferer_devices) if model.config is not None else None,
        "join_error": model.join_error,
        "error": model.error,
    }
