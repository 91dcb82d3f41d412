"""The --local inference stage as a child process, so generation and training share no GIL.

For a small model most of each forward pass is Python overhead, which two threads of one process
cannot overlap. The child (``python -m prime_node.ml.inference_worker``) loads the model directory
itself and reads each policy from a safetensors file the trainer leaves in a hand-off directory (or, for
policies older than a restart, from the checkpoints), so no weights cross the pipe. The byte protocol
(no pickle) runs over the child's stdin and a private copy of its stdout; anything else the child
prints goes to stderr:

    trainer -> child (stdin):   b"C" + u64be step      policy `step` is in the hand-off directory
                                b"S" + 8 zero bytes    stop
    child -> trainer (stdout):  u32be length + b"B" + u64be k + rollout.batch frame
                                u32be length + b"E" + UTF-8 error text
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import struct
import sys
from pathlib import Path
from typing import IO, Any

from prime_node.ml.tokenizer import load_tokenizer

_STEP = struct.Struct(">Q")
_LENGTH = struct.Struct(">I")
NOTICE_SIZE = 9
STOP = b"S" + bytes(8)
MAX_MESSAGE = 16 << 20


def handoff_path(folder: Path, step: int) -> Path:
    """Where the trainer leaves policy ``step`` for the child (older steps come from checkpoints)."""
    return folder / f"policy_{step:08d}.safetensors"


def step_notice(step: int) -> bytes:
    return b"C" + _STEP.pack(step)


def parse_batch_message(message: bytes) -> tuple[int, bytes] | str:
    """(k, frame) for a batch, or the child's error text."""
    if message[:1] == b"B" and len(message) > 9:
        return _STEP.unpack(message[1:9])[0], message[9:]
    if message[:1] == b"E":
        return message[1:].decode("utf-8", errors="replace")
    return f"unexpected message from the inference process: {message[:16]!r}"


def read_message(stream: IO[bytes]) -> bytes | None:
    """One length-prefixed message, or None at end of stream."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(header)
    if length > MAX_MESSAGE:
        return None
    body = stream.read(length)
    return body if len(body) == length else None


class _Notices:
    """Fixed-size notices from the trainer on a raw file descriptor, readable without blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def _fill(self, block: bool) -> bool:
        if not block and not select.select([self.fd], [], [], 0)[0]:
            return False
        chunk = os.read(self.fd, 4096)
        if not chunk:
            raise EOFError("the trainer closed the notice pipe")
        self.buffer += chunk
        return True

    def next(self, block: bool) -> bytes | None:
        while len(self.buffer) < NOTICE_SIZE:
            if not self._fill(block):
                return None
        notice, self.buffer = self.buffer[:NOTICE_SIZE], self.buffer[NOTICE_SIZE:]
        return notice


def _send(out: IO[bytes], message: bytes) -> None:
    out.write(_LENGTH.pack(len(message)) + message)
    out.flush()


def _generate(
    notices: _Notices,
    out: IO[bytes],
    config_json: str,
    source: Path,
    start: int,
    steps: list[int],
    root: Path,
    handoff: Path,
    device: str = "cpu",
) -> None:
    import torch

    from prime_node.config import RunConfig
    from prime_node.ml.checkpoint import read_weights, step_dir
    from prime_node.ml.engines import load_engine
    from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch, with_tied_head
    from prime_node.tasks.factory import build_task
    from protocol.codec import encode

    torch.set_num_threads(1)
    config = RunConfig.model_validate_json(config_json)
    tokenizer = load_tokenizer(source)
    task = build_task(config.task)
    dtype = config.inference_dtype
    engine = load_engine(
        source, tokenizer, engine=config.engine, dtype=dtype, device=device, policy_step=start
    )
    first = handoff_path(handoff, start)
    engine.load_weights(with_tied_head(engine.model, read_weights(first.parent, first.name)), start)
    latest = start
    for k in steps:
        policy = max(0, k - config.async_level)
        while (notice := notices.next(block=latest < policy)) is not None:
            if notice[:1] == b"S":
                return
            latest = max(latest, _STEP.unpack(notice[1:])[0])
        if engine.policy_step != policy:
            handed = handoff_path(handoff, policy)
            weights: dict[str, Any] = (
                read_weights(handed.parent, handed.name)
                if handed.exists()
                else read_weights(step_dir(root, policy))
            )
            engine.load_weights(with_tied_head(engine.model, weights), policy)
        batch = make_batch(
            engine, task, tokenizer, config, worker=LOCAL_WORKER, policy_step=policy, batch_counter=k
        )
        _send(out, b"B" + _STEP.pack(k) + encode(batch))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prime_node.ml.inference_worker")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--start", type=int, required=True)
    parser.add_argument("--end", type=int, required=True)
    parser.add_argument("--handoff", type=Path, required=True)
    parser.add_argument(
        "--skip", default="[]", help="JSON list of steps whose batches are replayed from the log"
    )
    parser.add_argument("--device", default="cpu", help="The trainer's device (hardware.select_device)")
    args = parser.parse_args(argv)
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the byte stream
    skip = set(json.loads(args.skip))
    steps = [k for k in range(args.start, args.end) if k not in skip]
    try:
        _generate(
            _Notices(0),
            protocol_out,
            args.config_json,
            args.source,
            args.start,
            steps,
            args.checkpoints,
            args.handoff,
            args.device,
        )
    except BaseException as exc:  # reported to the trainer, which raises it as a NodeError
        with contextlib.suppress(OSError):
            _send(protocol_out, b"E" + f"{type(exc).__name__}: {exc}".encode()[:4000])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
