"""Keep the signed rollout batches a node saw, so a person can check one later with ``prime-node validate``.

``--keep-batches N`` turns it on: every signed batch the node decodes is saved exactly as received (the
worker's signed envelope and all) as ``DATA_DIR/batches/<seq>-<id16>.batch``, with a sidecar
``<seq>-<id16>.json`` naming the batch id, the worker, the policy step it claims, when it arrived and
where that policy was on this disk (and where to look for it again), and once per run the run's config as
``run-<run>.json``. ``validate`` reads the sidecar, so ``prime-node validate DATA_DIR/batches/<file>``
needs no other argument while the policy is still on disk.

Bounded: the newest ``max_batches`` files, at most ``max_bytes`` of batch and sidecar bytes together; the
oldest go first, before the new one is written, so the directory never holds more. A frame larger than
``max_bytes`` alone is skipped (logged). Names never come from the network: the sequence number is ours,
and ``id16`` is the batch id's first 16 characters only when it is lowercase hex (else a hash of it).
Each file is written atomically (temporary, fsync, rename, directory fsync): a crash leaves the old
directory or the new one; leftovers of a crash are removed the next time the archive starts. Disk
failures are logged and the batch is not kept: keeping is a convenience, never a reason to drop a batch.

Synchronous (disk I/O): callers run ``keep`` in a thread; one lock makes concurrent calls safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_node.atomic_files import write_atomically
from prime_node.bounded_json import loads_bounded
from prime_node.errors import NodeError
from protocol.names import is_valid_name

if TYPE_CHECKING:
    from prime_node.config.run import RunConfig
    from prime_node.node_config import NodeConfig

log = logging.getLogger(__name__)

BATCH_SUFFIX = ".batch"
NOTE_SUFFIX = ".json"
NOTE_FORMAT = 1
MAX_NOTE_BYTES = 16 << 10
"""A sidecar this archive writes is well under 2 KiB; anything larger on disk is not ours."""
MAX_TEXT = 200
"""Characters of a network-supplied string (batch id, worker) a sidecar records."""
_NAME = re.compile(r"^(?P<seq>[0-9]{8,19})-(?P<label>[0-9a-f]{16})$")
_HEX_ID = re.compile(r"^[0-9a-f]{16,}$")
_LEFTOVER = re.compile(
    r"^\.(?P<name>[0-9]{8,19}-[0-9a-f]{16}\.(?:batch|json)|run-[a-z0-9._-]+\.json)\..*\.tmp$"
)


def label_of(batch_id: str) -> str:
    """16 lowercase hex characters for a file name: the id's own first 16 when it is lowercase hex (what
    ``validate`` prints), else the first 16 of its SHA-256. Never any other character of the id."""
    if _HEX_ID.fullmatch(batch_id):
        return batch_id[:16]
    return hashlib.sha256(batch_id.encode("utf-8", "backslashreplace")).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class KeptBatch:
    """One batch on disk: its frame file, its sidecar (None if a crash left it without one) and the bytes
    both take."""

    seq: int
    path: Path
    note: Path | None
    size: int


@dataclasses.dataclass(frozen=True)
class BatchNote:
    """What a sidecar says about its batch (``read_note``); every field checked, paths as written."""

    batch_id: str
    worker: str
    policy_step: int
    received_at: float
    policy_dir: Path | None
    policy_roots: tuple[Path, ...]
    run_config: Path | None
    """The run's config saved beside the batches (absolute), if the node knew it."""


class BatchArchive:
    """The kept batches of one node (module doc)."""

    def __init__(
        self,
        directory: Path,
        max_batches: int,
        max_bytes: int,
        *,
        policy_roots: Sequence[Path] = (),
        run_config: RunConfig | None = None,
    ) -> None:
        """``policy_roots``: directories holding this node's policies by step (the trainer's
        ``OUT/policies``, a worker's ``DATA_DIR/swarm/checkpoints``); ``run_config``: the run the batches
        belong to, saved once beside them so ``validate`` needs no ``--config``. Nothing touches the disk
        until the first ``keep`` or ``list_kept``."""
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("a batch archive keeps at least one batch and one byte")
        self.directory = directory
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.policy_roots = tuple(policy_roots)
        self.run_config = run_config
        self.kept = 0
        self.skipped = 0
        """Batches not kept: larger than ``max_bytes``, or a disk failure."""
        self.evicted = 0
        self._lock = threading.Lock()
        self._index: list[KeptBatch] | None = None
        self._next_seq = 0
        self._bytes = 0
        """Bytes of the batches and sidecars in ``_index``."""
        self._config_name: str | None = None

    # -- the two calls ----------------------------------------------------------------------------------

    def keep(
        self,
        frame: bytes,
        *,
        batch_id: str,
        worker: str,
        policy_step: int,
        received_at: float | None = None,
    ) -> Path | None:
        """Save ``frame`` as received with its sidecar; the batch file's path, or None when it was not
        kept (too large, or the disk failed: logged). ``received_at``: Unix seconds (default: the file's
        modification time)."""
        with self._lock:
            try:
                return self._keep(frame, batch_id, worker, policy_step, received_at)
            except NodeError as exc:
                self.skipped += 1
                log.warning("not keeping batch %s: %s", label_of(batch_id), exc)
                return None

    def list_kept(self) -> list[KeptBatch]:
        """The kept batches, oldest first."""
        with self._lock:
            try:
                return list(self._loaded())
            except NodeError as exc:
                log.warning("cannot list kept batches: %s", exc)
                return []

    @property
    def bytes_kept(self) -> int:
        with self._lock:
            return self._bytes

    # -- inside the lock --------------------------------------------------------------------------------

    def _keep(
        self, frame: bytes, batch_id: str, worker: str, policy_step: int, received_at: float | None
    ) -> Path | None:
        index = self._loaded()
        label = label_of(batch_id)
        stem = f"{self._next_seq:08d}-{label}"
        policy = find_policy(self.policy_roots, policy_step)
        config_name = self._saved_config()
        note: dict[str, Any] = {
            "format": NOTE_FORMAT,
            "batch_id": batch_id[:MAX_TEXT],
            "worker": worker[:MAX_TEXT],
            "policy_step": policy_step,
            "received_at": received_at,
            "policy_dir": None if policy is None else os.path.abspath(policy),
            "policy_roots": [os.path.abspath(root) for root in self.policy_roots],
            "run_config": config_name,
        }
        note_size = len(_note_bytes(note, 0.0)) + 32  # the time's digits may vary: a margin
        size = len(frame) + note_size
        if size > self.max_bytes:
            self.skipped += 1
            log.warning(
                "not keeping batch %s: %d bytes with its sidecar, more than the archive's %d",
                label,
                size,
                self.max_bytes,
            )
            return None
        while index and (len(index) + 1 > self.max_batches or self._bytes + size > self.max_bytes):
            self._evict(index.pop(0))
        path = self.directory / (stem + BATCH_SUFFIX)
        write_atomically(path, frame)
        if received_at is None:
            received_at = _mtime(path)
        encoded = _note_bytes(note, received_at)
        note_path = self.directory / (stem + NOTE_SUFFIX)
        try:
            write_atomically(note_path, encoded)
        except NodeError:
            path.unlink(missing_ok=True)
            raise
        self._next_seq += 1
        index.append(KeptBatch(self._next_seq - 1, path, note_path, len(frame) + len(encoded)))
        self._bytes += index[-1].size
        self.kept += 1
        return path

    def _loaded(self) -> list[KeptBatch]:
        if self._index is None:
            self._index = _scan(self.directory)
            self._bytes = sum(item.size for item in self._index)
            self._next_seq = self._index[-1].seq + 1 if self._index else 0
        return self._index

    def _evict(self, item: KeptBatch) -> None:
        self.evicted += 1
        self._bytes -= item.size
        for path in (item.path, item.note):
            if path is None:
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove kept batch file %s: %s", path, exc.strerror or exc)

    def _saved_config(self) -> str | None:
        """``run-<run>.json`` beside the batches, written once (None without a run config): the run's
        config as the node believed it, every field (``read_run_config`` loads it back)."""
        config = self.run_config
        if config is None or not is_valid_name(config.run_id):
            return None
        name = f"run-{config.run_id}.json"
        if self._config_name != name:
            text = json.dumps(config.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"
            write_atomically(self.directory / name, text)
            self._config_name = name
        return name


def _note_bytes(note: dict[str, Any], received_at: float) -> bytes:
    return json.dumps({**note, "received_at": round(received_at, 3)}, sort_keys=True).encode() + b"\n"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _scan(directory: Path) -> list[KeptBatch]:
    """The kept batches already on disk (a restart), oldest first; crash leftovers (temporaries, a
    sidecar without its batch) removed. Only regular files with our names are looked at."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise NodeError(f"cannot read {directory}: {exc.strerror or exc}", reason="io_error") from exc
    files: dict[str, dict[str, int]] = {}
    for entry in entries:
        if _LEFTOVER.match(entry.name) and entry.is_file(follow_symlinks=False):
            _remove(Path(entry.path))
            continue
        stem, _, suffix = entry.name.rpartition(".")
        if not _NAME.match(stem) or f".{suffix}" not in (BATCH_SUFFIX, NOTE_SUFFIX):
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            files.setdefault(stem, {})[suffix] = entry.stat(follow_symlinks=False).st_size
        except OSError:
            continue
    found = []
    for stem, sizes in files.items():
        if "batch" not in sizes:
            _remove(directory / (stem + NOTE_SUFFIX))
            continue
        note = directory / (stem + NOTE_SUFFIX) if "json" in sizes else None
        match = _NAME.match(stem)
        assert match is not None
        seq = int(match["seq"])
        found.append(KeptBatch(seq, directory / (stem + BATCH_SUFFIX), note, sum(sizes.values())))
    return sorted(found, key=lambda item: item.seq)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc.strerror or exc)


# -- finding a policy, reading a sidecar (also what `prime-node validate` uses) ---------------------------


def is_model_dir(directory: Path) -> bool:
    """A directory ``validate`` can load: ``config.json`` and safetensors weights (a delta version's
    directory, which holds ``weights.delta`` only, is not one)."""
    try:
        return (
            directory.is_dir()
            and (directory / "config.json").is_file()
            and any(directory.glob("*.safetensors"))
        )
    except OSError:
        return False


def find_policy(roots: Sequence[Path], step: int) -> Path | None:
    """Policy ``step`` under one of ``roots``, loadable: the trainer's ``step_00000012`` or a weight-swarm
    store's ``step-12-<id16>`` (the full version, not a delta)."""
    if step < 0:
        return None
    for root in roots:
        candidates = [root / f"step_{step:08d}"]
        with contextlib.suppress(OSError):
            candidates += sorted(root.glob(f"step-{step}-*"))
        for candidate in candidates:
            if is_model_dir(candidate):
                return candidate
    return None


def note_path_of(batch_path: Path) -> Path:
    return batch_path.with_suffix(NOTE_SUFFIX)


def read_note(batch_path: Path) -> BatchNote | None:
    """The sidecar beside a kept batch, checked field by field; None if there is none or it is not one
    this archive wrote (logged: a hand-edited or damaged file is a reason to ask for flags, not to fail)."""
    path = note_path_of(batch_path)
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_NOTE_BYTES + 1)
    except OSError:
        return None
    try:
        if len(raw) > MAX_NOTE_BYTES:
            raise ValueError("too large")
        data = loads_bounded(raw, max_depth=4)
        if not isinstance(data, dict) or data.get("format") != NOTE_FORMAT:
            raise ValueError("not a sidecar of this format")
        step = data["policy_step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError("policy_step is not an integer")
        received = data.get("received_at")
        roots = data.get("policy_roots") or []
        if not isinstance(roots, list) or not all(isinstance(r, str) for r in roots):
            raise ValueError("policy_roots is not a list of paths")
        return BatchNote(
            batch_id=str(data.get("batch_id", ""))[:MAX_TEXT],
            worker=str(data.get("worker", ""))[:MAX_TEXT],
            policy_step=step,
            received_at=float(received) if isinstance(received, int | float) else 0.0,
            policy_dir=_optional_path(data.get("policy_dir")),
            policy_roots=tuple(Path(root) for root in roots),
            run_config=_config_beside(batch_path, data.get("run_config")),
        )
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None


def _optional_path(value: object) -> Path | None:
    return Path(value) if isinstance(value, str) and value else None


def _config_beside(batch_path: Path, name: object) -> Path | None:
    """The saved run config, only by a name this archive writes, in the batch's own directory."""
    if not isinstance(name, str):
        return None
    run = name.removeprefix("run-").removesuffix(".json")
    if name != f"run-{run}.json" or not is_valid_name(run):
        return None
    return batch_path.parent / name


MAX_RUN_CONFIG_BYTES = 1 << 20


def read_run_config(path: Path) -> RunConfig:
    """A run config this archive saved (``run-<run>.json``); NodeError ``bad_config`` if unreadable."""
    from prime_node.config.run import validate_run_config

    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_RUN_CONFIG_BYTES + 1)
        if len(raw) > MAX_RUN_CONFIG_BYTES:
            raise ValueError("too large")
        data = loads_bounded(raw, max_depth=8)
    except (OSError, ValueError) as exc:
        raise NodeError(f"cannot read the saved run config {path}: {exc}", reason="bad_config") from exc
    if not isinstance(data, dict):
        raise NodeError(f"{path} is not a run config", reason="bad_config")
    return validate_run_config(data, source=str(path))


def open_archive(
    node: NodeConfig, *, policy_roots: Sequence[Path] = (), run_config: RunConfig | None = None
) -> BatchArchive | None:
    """The archive ``--keep-batches`` asks for: ``DATA_DIR/batches``, ``keep_batches`` files of at most
    ``keep_batches_max_bytes`` together; None when it is off (0)."""
    if node.keep_batches <= 0:
        return None
    return BatchArchive(
        node.data_dir / "batches",
        node.keep_batches,
        node.keep_batches_max_bytes,
        policy_roots=policy_roots,
        run_config=run_config,
    )
