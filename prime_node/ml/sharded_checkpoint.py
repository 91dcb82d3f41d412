"""Sharded training state (model + optimizer) with torch.distributed.checkpoint, for resume after a kill.

    ROOT/sharded_00000012/
        __0_0.distcp, __1_0.distcp, ...   each rank's shards of the weights and AdamW moments (DCP)
        .metadata                          DCP's index of the shards (global shapes, chunk offsets)
        complete.json                      written last: step, world size, meta, file sizes, optimizer
                                           hyper-parameters

Every rank writes only its own shards (FSDP2 DTensors, or whole tensors at world size 1), so saving costs
no gather and no rank ever holds the full optimizer state. The checkpoint is built under
``.sharded_00000012.tmp``; after every rank has written, rank 0 adds ``complete.json`` and renames the
directory into place. A kill at any moment therefore leaves the previous checkpoint and, at worst, a
temporary directory that nothing loads and the next save removes. The Hugging Face directories the swarm
shares are written elsewhere (``checkpoint.py``); these hold what only the trainer needs to continue.

``AsyncShardedSaver`` runs a save on a background thread over views of the live shards (no copy), on a
process group of its own; the trainer's next optimizer step waits for it (the session wires
``GRPOTrainer.before_update``), so the write overlaps the next forward and backward and never races the
optimizer. ``state_save_due`` is the pure rule of when to save (``checkpoint_every``).

Loading (``load_sharded``, which refuses anything in a tampered directory that could run code) is
sharded_load.py. With several machines, ROOT must be a file system every rank sees (rank 0 lists and
renames what the others wrote).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from prime_node.atomic_files import fsync_directory, node_error_from_os, write_atomically
from prime_node.bounded_json import loads_bounded
from prime_node.errors import NodeError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MARKER = "complete.json"
_FINAL_DIR = re.compile(r"^sharded_(\d{8})$")
_TEMP_DIR = re.compile(r"^\.sharded_(\d{8})\.(tmp|old)$")
_MAX_WORLD_SIZE = 1 << 20


@dataclass(frozen=True)
class ShardedCheckpoint:
    """A complete sharded checkpoint, as its marker describes it."""

    step: int
    path: Path
    world_size: int
    """How many ranks wrote it (it loads at any world size: DCP reshards)."""
    meta: dict[str, object]
    optimizer_groups: list[dict[str, object]]
    """The optimizer's hyper-parameters per parameter group (everything but the parameters)."""


def sharded_dir(root: Path, step: int) -> Path:
    return root / f"sharded_{step:08d}"


def _temp_dir(root: Path, step: int, kind: str = "tmp") -> Path:
    return root / f".sharded_{step:08d}.{kind}"


# --- process group -----------------------------------------------------------------------------------


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def current_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


@contextlib.contextmanager
def alone_is_intended() -> Iterator[None]:
    """DCP warns whenever one process without a process group saves or loads: that is world size 1 here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank0_outcome(error: NodeError | None, group: dist.ProcessGroup | None = None) -> None:
    """Every rank raises rank 0's NodeError (so no rank waits in a collective the others left)."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    # Pickled by torch between the ranks of this one job (never read from disk or the network).
    outcome: list[list[str] | None] = [None if error is None else [str(error), error.reason]]
    dist.broadcast_object_list(outcome, src=0, group=group)
    failure = outcome[0]
    if failure is not None:
        raise NodeError(failure[0], reason=failure[1])


# --- saving ------------------------------------------------------------------------------------------


def save_sharded(
    root: Path, step: int, model: Any, optimizer: torch.optim.Optimizer, *, meta: dict[str, object]
) -> Path:
    """Write the model and optimizer state of policy ``step`` under ``root``; collective on every rank.

    Returns the checkpoint directory once it is visible to ``newest_sharded``. ``meta`` (JSON-able) comes
    back from ``load_sharded``. NodeError ``checkpoint_failed`` if writing fails on any rank.
    """
    job = _SaveJob.of(root, step, model, optimizer, meta, None)
    job.run()
    if job.error is not None:
        raise job.error
    return sharded_dir(root, step)


class _SaveJob:
    """One save: the state's tensors as they are (views of the live shards, no copy) and what the marker
    needs, captured on the caller's thread; ``run`` writes them (on any thread)."""

    def __init__(
        self,
        root: Path,
        step: int,
        state: dict[str, Any],
        groups: list[dict[str, object]],
        meta: dict[str, object],
        group: dist.ProcessGroup | None,
    ) -> None:
        self.root, self.step, self.state, self.groups, self.meta, self.group = (
            root,
            step,
            state,
            groups,
            meta,
            group,
        )
        self.error: NodeError | None = None
        self.seconds = 0.0

    @classmethod
    def of(
        cls,
        root: Path,
        step: int,
        model: Any,
        optimizer: torch.optim.Optimizer,
        meta: dict[str, object],
        group: dist.ProcessGroup | None,
    ) -> _SaveJob:
        marker_meta = json.loads(json.dumps(meta))  # refuse what JSON cannot hold before any rank writes
        model_state, optimizer_state = get_state_dict(model, optimizer)
        tensors, groups = _split_optimizer_state(optimizer_state)
        return cls(root, step, {"model": model_state, "optimizer": tensors}, groups, marker_meta, group)

    def run(self) -> None:
        began = time.perf_counter()
        try:
            self._write()
        except NodeError as exc:
            self.error = exc
        finally:
            self.state = {}  # the live tensors are not held past the save
            self.seconds = time.perf_counter() - began

    def _write(self) -> None:
        root, step, group = self.root, self.step, self.group
        temp = _temp_dir(root, step)
        error: NodeError | None = None
        if _rank() == 0:
            try:
                _remove_stale_temporaries(root)
                temp.mkdir(parents=True)
            except OSError as exc:
                error = node_error_from_os(exc, f"preparing checkpoint directory {temp}")
        _rank0_outcome(error, group)
        try:
            with alone_is_intended():
                dcp_save(
                    self.state,
                    storage_writer=FileSystemWriter(str(temp), sync_files=True),
                    process_group=group,
                    no_dist=not is_distributed(),
                )
        except CheckpointException as exc:  # raised on every rank when any rank failed
            raise NodeError(
                f"writing sharded checkpoint {temp} failed: {exc}", reason="checkpoint_failed"
            ) from exc
        final = sharded_dir(root, step)
        if _rank() == 0:
            try:
                _publish(root, temp, final, step, self.meta, self.groups)
            except (OSError, NodeError) as exc:
                error = exc if isinstance(exc, NodeError) else node_error_from_os(exc, f"publishing {final}")
                error = NodeError(str(error), reason="checkpoint_failed")
        _rank0_outcome(error, group)


class AsyncShardedSaver:
    """``save_sharded`` off the training loop's path: ``submit`` captures the state (views of the live
    shards: no copy, so no second 12 bytes per parameter in memory) and a background thread writes it.

    Nothing may change the live weights or AdamW moments until the save is done: the trainer calls
    ``wait`` right before its optimizer step (``GRPOTrainer.before_update``), which is the only thing
    that changes them in place, and a step's forward and backward (most of its time) overlap the write.
    The background saves talk over a gloo process group of their own (made here: construct on every
    rank at the same point), so their collectives never interleave with the step's. One save at a
    time; ``keep`` complete saves are kept (rank 0 prunes after publishing). Collective on every rank:
    ``__init__``, ``submit`` (every rank the same steps) and ``close``.
    """

    def __init__(self, root: Path, *, meta: dict[str, object], keep: int = 1) -> None:
        self.root, self.meta, self.keep = root, meta, keep
        self._group = dist.new_group(backend="gloo") if is_distributed() else None
        self._thread: threading.Thread | None = None
        self._job: _SaveJob | None = None
        self.last_seconds: float | None = None
        """Wall time of the last finished save (written in the background), for ``state_save_due``."""
        self.saved_step: int | None = None
        """The step of the last finished save."""

    def submit(self, step: int, model: Any, optimizer: torch.optim.Optimizer) -> None:
        """Start saving ``step`` (after the previous save has finished); NodeError ``checkpoint_failed``
        if the previous one failed."""
        self.wait()
        job = _SaveJob.of(self.root, step, model, optimizer, self.meta, self._group)
        self._job = job
        self._thread = threading.Thread(target=self._run, args=(job,), name="state-saver", daemon=True)
        self._thread.start()

    def _run(self, job: _SaveJob) -> None:
        torch.set_num_threads(1)  # per OS thread: serialising shards needs no pool beside the step's
        job.run()
        if job.error is None and _rank() == 0 and self.keep > 0:
            prune_sharded(self.root, self.keep)

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Until the save under way (if any) is complete; NodeError if it failed."""
        thread, job = self._thread, self._job
        if thread is None or job is None:
            return
        thread.join()
        self._thread = self._job = None
        self.last_seconds = job.seconds
        if job.error is not None:
            raise job.error
        self.saved_step = job.step

    def close(self) -> None:
        self.wait()


def state_save_due(
    *,
    every: int | None,
    step: int,
    final: bool,
    seconds_since_save: float,
    last_save_s: float | None,
    share: float = 0.1,
) -> bool:
    """Should the training state of ``step`` be saved? ``every``: after every that many steps (and the
    final one). None ("auto"): when the last save's wall time is at most ``share`` of the training time
    since it was started, so saving costs at most that share of the run's time, whatever the model and
    disk (a save runs beside the next step, but it competes with it for cores, memory bandwidth and
    disk); the first save (nothing measured yet) and the final step always save."""
    if final or step == 0:
        return True
    if every is not None:
        return step % every == 0
    if last_save_s is None:
        return True
    return last_save_s <= share * seconds_since_save


def _split_optimizer_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, object]]]:
    """(per-parameter tensors for DCP, JSON-able hyper-parameters per group)."""
    for fqn, entry in state["state"].items():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {fqn}.{key} is not a tensor: only tensor state is saved")
    groups = [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]]
    return state["state"], json.loads(json.dumps(groups))


def _remove_stale_temporaries(root: Path) -> None:
    """Temporaries of saves a kill interrupted (only one save runs at a time: it is collective)."""
    if not root.is_dir():
        return
    for item in root.iterdir():
        if _TEMP_DIR.match(item.name) and item.is_dir():
            log.info("removing %s, left by an interrupted checkpoint save", item)
            shutil.rmtree(item, ignore_errors=True)


def _publish(
    root: Path, temp: Path, final: Path, step: int, meta: dict[str, object], groups: list[dict[str, object]]
) -> None:
    files = {item.name: item.stat().st_size for item in sorted(temp.iterdir()) if item.is_file()}
    marker = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": current_world_size(),
        "meta": meta,
        "files": files,
        "optimizer_groups": groups,
    }
    write_atomically(temp / MARKER, json.dumps(marker, sort_keys=True))  # fsyncs temp's entries too
    if final.exists():  # the same step saved again (after a resume): the old copy goes aside first
        old = _temp_dir(root, step, "old")
        os.rename(final, old)
        os.rename(temp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(temp, final)
    fsync_directory(root)


# --- finding -----------------------------------------------------------------------------------------


def list_sharded(root: Path) -> list[ShardedCheckpoint]:
    """Complete sharded checkpoints under ``root``, oldest first. Directories without a valid marker, or
    whose files are missing or cut short, are skipped with a log line."""
    if not root.is_dir():
        return []
    found = []
    for item in sorted(root.iterdir()):
        match = _FINAL_DIR.match(item.name)
        if match is None or not item.is_dir():
            continue
        try:
            found.append(_read_marker(item, int(match.group(1))))
        except NodeError as exc:
            log.warning("skipping sharded checkpoint %s: %s", item, exc)
    return found


def newest_sharded(root: Path) -> ShardedCheckpoint | None:
    """The newest complete sharded checkpoint under ``root``, or None."""
    found = list_sharded(root)
    return found[-1] if found else None


def _read_marker(path: Path, step: int) -> ShardedCheckpoint:
    def bad(why: str) -> NodeError:
        return NodeError(f"{path / MARKER}: {why}", reason="bad_checkpoint")

    try:
        raw = (path / MARKER).read_bytes()
    except OSError as exc:
        raise bad(f"unreadable ({exc.strerror or exc})") from exc
    if len(raw) > 1 << 20:
        raise bad("larger than 1 MiB")
    try:
        marker = loads_bounded(raw)
    except (ValueError, RecursionError) as exc:
        raise bad(f"not JSON ({exc})") from exc
    if not isinstance(marker, dict) or marker.get("format") != FORMAT_VERSION:
        raise bad(f"not a format-{FORMAT_VERSION} marker")
    world_size, meta, files, groups = (
        marker.get(k) for k in ("world_size", "meta", "files", "optimizer_groups")
    )
    if not _is_int(marker.get("step")) or marker["step"] != step:
        raise bad(f"its step {marker.get('step')!r} is not the directory's {step}")
    if not isinstance(world_size, int) or isinstance(world_size, bool):
        raise bad(f"world size {world_size!r}")
    if not 1 <= world_size <= _MAX_WORLD_SIZE:
        raise bad(f"world size {world_size!r}")
    if not isinstance(meta, dict):
        raise bad("meta is not an object")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise bad("optimizer_groups is not a list of objects")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise bad("no file list with .metadata")
    for name, size in files.items():
        if not _plain_file_name(name) or not _is_int(size) or size < 0:
            raise bad(f"bad file entry {name!r}: {size!r}")
        try:
            actual = (path / name).stat().st_size
        except OSError as exc:
            raise bad(f"{name} is missing") from exc
        if actual != size:
            raise bad(f"{name} has {actual} bytes, the marker says {size}")
    return ShardedCheckpoint(step, path, world_size, meta, groups)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_file_name(name: str) -> bool:
    return (
        bool(name)
        and name not in (".", "..", MARKER)
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def prune_sharded(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints (all of them if ``keep`` <= 0); also remove incomplete
    ``sharded_*`` directories older than the newest complete one (nothing would ever load them)."""
    complete = list_sharded(root)
    if keep <= 0 or not complete:
        return
    kept = {c.path for c in complete[-keep:]}
    newest = complete[-1].step
    for item in root.iterdir():
        match = _FINAL_DIR.match(item.name)
        if match is None or item in kept or int(match.group(1)) >= newest:
            continue
        shutil.rmtree(item, ignore_errors=True)
