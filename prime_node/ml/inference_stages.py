"""The inference stage of ``run-trainer --local``, as a thread or as a child process.

``PolicyStore`` holds the policies the training loop publishes; ``inference_loop`` is the thread stage
(batch k from policy max(0, k - async_level)); ``ChildInference`` is the same stage in a child process,
speaking prime_node/ml/inference_worker.py's byte protocol. local_run.py pipelines them with training.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

import prime_node
from prime_node.config import RunConfig
from prime_node.errors import NodeError
from prime_node.ml.checkpoint import read_weights, step_dir
from prime_node.ml.engine import TorchEngine
from prime_node.ml.inference_worker import STOP, handoff_path, parse_batch_message, read_message, step_notice
from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch, with_tied_head
from prime_node.tasks.base import TaskSource
from prime_node.warm_start.launcher import WarmStart
from prime_node.warm_start.process import WarmProcess
from protocol.codec import decode, encode
from protocol.rollouts import RolloutBatch


class PolicyStore:
    """Policy weights published by the training loop, awaited by the inference thread."""

    def __init__(self, checkpoint_root: Path, keep: int) -> None:
        self._root = checkpoint_root
        self._keep = keep
        self._weights: dict[int, dict[str, torch.Tensor]] = {}
        self._latest = -1
        self._cond = threading.Condition()
        self.stopped = False

    def publish(self, step: int, weights: dict[str, torch.Tensor]) -> None:
        with self._cond:
            self._weights[step] = weights
            self._latest = max(self._latest, step)
            for old in sorted(self._weights)[: -self._keep]:
                del self._weights[old]
            self._cond.notify_all()

    def mark_available(self, step: int) -> None:
        """Policies up to ``step`` exist on disk (after a restart)."""
        with self._cond:
            self._latest = max(self._latest, step)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def wait_for(self, step: int) -> dict[str, torch.Tensor] | None:
        with self._cond:
            while self._latest < step and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return None
            found = self._weights.get(step)
        return found if found is not None else read_weights(step_dir(self._root, step))


class ChildInference:
    """The inference stage in a child process (``local_inference = "process"``); see
    prime_node/ml/inference_worker.py for the byte protocol. ``get`` mirrors the thread stage's queue."""

    def __init__(
        self,
        config: RunConfig,
        source: Path,
        start: int,
        skip: list[int],
        root: Path,
        start_weights: dict[str, torch.Tensor] | Path,
        *,
        device: str = "cpu",
    ) -> None:
        self.handoff = config.output_dir / "inference-handoff"
        shutil.rmtree(self.handoff, ignore_errors=True)
        self.handoff.mkdir(parents=True)
        self.keep = config.async_level + 2
        self.start = start
        self._write_handoff(start, start_weights)

        package_root = str(Path(prime_node.__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        }
        command = [
            sys.executable,
            "-m",
            "prime_node.ml.inference_worker",
            "--config-json",
            config.model_dump_json(),
            "--source",
            str(source),
            "--checkpoints",
            str(root),
            "--start",
            str(start),
            "--end",
            str(config.max_steps),
            "--skip",
            json.dumps(skip),
            "--handoff",
            str(self.handoff),
            "--device",
            device,
        ]
        # Forked ready from a warm-start server when an owner named one (demo, test session): no import.
        warm = WarmStart.attach(env)
        pipe = subprocess.PIPE
        process = None if warm is None else warm.popen(command, env=env, stdin=pipe, stdout=pipe)
        self._process: subprocess.Popen[bytes] | WarmProcess = process or subprocess.Popen(
            command, env=env, stdin=pipe, stdout=pipe
        )
        self._lock = threading.Lock()

    def publish(self, step: int, weights: dict[str, torch.Tensor] | Path) -> None:
        """Hand policy ``step`` to the child: a weights file in the hand-off directory (not fsynced: it is
        a message, not a checkpoint; a finished safetensors file is hard-linked), then a notice. Older
        hand-off files are removed."""
        self._write_handoff(step, weights)
        self._notice(step_notice(step))
        if step - self.keep != self.start:  # the child may still be starting up from that one
            handoff_path(self.handoff, step - self.keep).unlink(missing_ok=True)

    def _write_handoff(self, step: int, weights: dict[str, torch.Tensor] | Path) -> None:
        from safetensors.torch import save_file

        path = handoff_path(self.handoff, step)
        temp = path.with_suffix(".tmp")
        temp.unlink(missing_ok=True)
        if isinstance(weights, Path):
            try:
                os.link(weights, temp)
            except OSError:  # another file system, or one without hard links
                shutil.copyfile(weights, temp)
        else:
            save_file(weights, str(temp))
        os.replace(temp, path)

    def _notice(self, notice: bytes) -> None:
        assert self._process.stdin is not None
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._process.stdin.write(notice)
            self._process.stdin.flush()

    def get(self) -> tuple[int, Any]:
        assert self._process.stdout is not None
        message = read_message(self._process.stdout)
        if message is None:
            return -1, NodeError("the inference process exited unexpectedly", reason="inference_failed")
        parsed = parse_batch_message(message)
        if isinstance(parsed, str):
            return -1, NodeError(f"the inference process failed: {parsed}", reason="inference_failed")
        k, frame = parsed
        return k, (decode(frame, RolloutBatch), frame)

    def stop(self) -> None:
        self._notice(STOP)
        with contextlib.suppress(OSError, ValueError):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except Exception:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        shutil.rmtree(self.handoff, ignore_errors=True)


def inference_loop(
    engine: TorchEngine,
    store: PolicyStore,
    out: queue.Queue[tuple[int, Any]],
    task: TaskSource,
    tokenizer: Any,
    config: RunConfig,
    steps: list[int],
    threads: int,
) -> None:
    # torch's intra-op thread count is per OS thread here (OpenMP): a new thread would otherwise use
    # every core, oversubscribing the CPU the training thread needs (measured: 10x slower matmuls).
    torch.set_num_threads(threads)
    try:
        for k in steps:
            policy = max(0, k - config.async_level)
            weights = store.wait_for(policy)
            if weights is None:
                return
            if engine.policy_step != policy:
                engine.load_weights(with_tied_head(engine.model, weights), policy)
            batch = make_batch(
                engine, task, tokenizer, config, worker=LOCAL_WORKER, policy_step=policy, batch_counter=k
            )
            out.put((k, (batch, encode(batch))))  # encoded here, off the training thread
    except BaseException as exc:  # handed to the training loop, which re-raises it
        out.put((-1, exc))
