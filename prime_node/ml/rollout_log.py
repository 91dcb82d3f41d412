"""An append-only, fsynced log of accepted rollout batches, so a killed trainer loses none.

Record: b"PNRL" ‖ u32 BE frame length ‖ u64 BE trainer step ‖ SHA-256(frame) ‖ frame (a rollout.batch
codec frame). A batch is appended and fsynced *before* the trainer trains on it; after a restart the
trainer replays every record whose step is not yet covered by its checkpoint. A torn or corrupt tail
(a kill mid-append) is cut off at the last whole record.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

from crypto.digests import sha256
from prime_node.atomic_files import atomic_writer
from protocol.codec import decode
from protocol.errors import RemoteProtocolError
from protocol.rollouts import MAX_BATCH_BYTES, RolloutBatch

log = logging.getLogger(__name__)
_MAGIC = b"PNRL"
_HEADER = struct.Struct(">4sIQ32s")


class RolloutLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._records = self._scan_and_repair()

    def _scan_and_repair(self) -> list[tuple[int, bytes]]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        records: list[tuple[int, bytes]] = []
        offset = 0
        while offset + _HEADER.size <= len(data):
            magic, length, step, digest = _HEADER.unpack_from(data, offset)
            end = offset + _HEADER.size + length
            if magic != _MAGIC or length > MAX_BATCH_BYTES or end > len(data):
                break
            frame = data[offset + _HEADER.size : end]
            if sha256(frame) != digest:
                break
            records.append((step, frame))
            offset = end
        if offset != len(data):
            log.warning(
                "rollout log %s: cutting %d bytes of torn or corrupt tail", self.path, len(data) - offset
            )
            with open(self.path, "r+b") as handle:
                handle.truncate(offset)
                handle.flush()
                os.fsync(handle.fileno())
        return records

    def append(self, step: int, frame: bytes) -> None:
        """Durably record that ``frame`` was accepted for training step ``step``."""
        record = _HEADER.pack(_MAGIC, len(frame), step, sha256(frame)) + frame
        with open(self.path, "ab") as handle:
            handle.write(record)
            handle.flush()
            os.fsync(handle.fileno())
        self._records.append((step, frame))

    def batches_from(self, step: int) -> dict[int, RolloutBatch]:
        """Accepted batches for training steps >= ``step``, by step (records that fail to decode skipped)."""
        found: dict[int, RolloutBatch] = {}
        for record_step, frame in self._records:
            if record_step < step:
                continue
            try:
                found[record_step] = decode(frame, RolloutBatch)
            except RemoteProtocolError as exc:
                log.warning("rollout log %s: skipping an undecodable record: %s", self.path, exc)
        return found

    def frames_by_step(self) -> dict[int, list[bytes]]:
        """Every logged frame by its step, in log order (a networked step merges several batches)."""
        frames: dict[int, list[bytes]] = {}
        for step, frame in self._records:
            frames.setdefault(step, []).append(frame)
        return frames

    def compact(self, keep_from_step: int) -> int:
        """Atomically drop records for steps before ``keep_from_step`` (already inside a checkpoint the
        trainer keeps); returns how many were dropped."""
        kept = [(step, frame) for step, frame in self._records if step >= keep_from_step]
        dropped = len(self._records) - len(kept)
        if dropped == 0:
            return 0
        with atomic_writer(self.path) as handle:
            for step, frame in kept:
                handle.write(_HEADER.pack(_MAGIC, len(frame), step, sha256(frame)) + frame)
        self._records = kept
        return dropped

    def __len__(self) -> int:
        return len(self._records)
