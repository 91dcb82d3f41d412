"""The trainer's background checkpoint writer: a step's checkpoint finished off the training loop."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from prime_node.errors import NodeError
from prime_node.ml.checkpoint import prune_checkpoints, write_checkpoint


class CheckpointWriter:
    """Finishes step checkpoints on a background thread, in order, from weights files the ranks have
    written already (``write_safetensors_shards``): hard-linked in, fsynced, renamed into place.

    The training loop pays only for writing the weights into the page cache; the fsyncs run while the
    next step trains. What the writer gets is a finished file, never tensors the optimizer may change.
    A kill may leave the newest checkpoint a step or two behind: every batch trained since is in the
    rollout log, and a restart replays them.
    """

    def __init__(
        self,
        root: Path,
        base_dir: Path,
        keep: int,
        extra: dict[str, Any],
        on_written: Callable[[int], None] | None = None,
    ) -> None:
        self._on_written = on_written
        self._jobs: queue.Queue[tuple[int, Path] | None] = queue.Queue()
        self.written = -1
        """The newest step finished (read by the training thread: staging files up to it may go)."""
        self._root, self._base, self._keep, self._extra = root, base_dir, keep, extra
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # torch's intra-op thread count is per OS thread (OpenMP); copying tensors needs no more than one.
        torch.set_num_threads(1)
        while (job := self._jobs.get()) is not None:
            step, weights = job
            try:
                write_checkpoint(self._root, step, weights, None, self._base, self._extra)
                self.written = step
                if self._on_written is not None:
                    self._on_written(step)
                prune_checkpoints(self._root, self._keep)
            except BaseException as exc:
                self._error = exc
                return

    def submit(self, step: int, weights: Path) -> None:
        if self._error is not None:
            raise NodeError(f"writing a checkpoint failed: {self._error}", reason="checkpoint_failed")
        self._jobs.put((step, weights))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        if self._error is not None:
            raise NodeError(f"writing a checkpoint failed: {self._error}", reason="checkpoint_failed")
