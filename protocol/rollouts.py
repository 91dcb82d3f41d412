"""The rollout batch wire format (version 1): what an inferer signs and the trainer admits.

A ``rollout.batch`` is one worker's output for one schedule draw (protocol/schedule.py): ``groups``
tasks, each sampled ``group_size`` times, laid out group by group. Per sample it carries the prompt and
completion token ids (u32 little-endian), the per-token log-probs the worker observed (f32 LE, one per
completion token) and a proof slot: TOPLOC commitments, 258 bytes per started chunk of 32 completion
tokens (empty until a proof is attached). Rewards are deliberately absent: the trainer recomputes them
with the task's checker. The batch travels as the payload of a signed Envelope whose signer must equal
``worker``; everything a validator needs to recompute the draw (worker, policy step, batch counter) and
replay sampling (seeds, temperature) is inside the signed bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Annotated

from crypto.keys import Address
from protocol.codec import IntRange, MaxLen, Message, message
from protocol.errors import InvariantError

FORMAT_VERSION = 1
MAX_PROMPT_TOKENS = 8192
MAX_COMPLETION_TOKENS = 16384
MAX_SAMPLES = 4096
PROOF_CHUNK_TOKENS = 32
PROOF_CHUNK_BYTES = 258
MAX_BATCH_BYTES = 8 << 20  # an Envelope's payload cap: a batch is signed as one payload
MAX_SAMPLE_BYTES = 4 * (MAX_PROMPT_TOKENS + 2 * MAX_COMPLETION_TOKENS) + PROOF_CHUNK_BYTES * 512 + 256
_U63 = (1 << 63) - 1
_TOKEN_LIMIT = (1 << 31) - 1


def proof_size(completion_tokens: int) -> int:
    """Bytes of a complete TOPLOC proof for a completion of this many tokens."""
    return PROOF_CHUNK_BYTES * math.ceil(completion_tokens / PROOF_CHUNK_TOKENS)


def pack_tokens(tokens: list[int] | tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(data) // 4}I", data)


def pack_logprobs(values: list[float] | tuple[float, ...]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def unpack_logprobs(data: bytes) -> tuple[float, ...]:
    return struct.unpack(f"<{len(data) // 4}f", data)


@message("rollout.sample", max_bytes=MAX_SAMPLE_BYTES)
@dataclass(frozen=True)
class RolloutSample(Message):
    """One sampled completion of one task (token ids as u32 LE, log-probs as f32 LE)."""

    task_id: Annotated[int, IntRange(0, _U63)]
    seed: Annotated[int, IntRange(0, _U63)]
    prompt: Annotated[bytes, MaxLen(4 * MAX_PROMPT_TOKENS)]
    completion: Annotated[bytes, MaxLen(4 * MAX_COMPLETION_TOKENS)]
    logprobs: Annotated[bytes, MaxLen(4 * MAX_COMPLETION_TOKENS)]
    finished: bool
    proof: Annotated[bytes, MaxLen(PROOF_CHUNK_BYTES * (MAX_COMPLETION_TOKENS // PROOF_CHUNK_TOKENS))]

    def __post_init__(self) -> None:
        if len(self.prompt) % 4 or not self.prompt:
            raise InvariantError("prompt must be a non-empty sequence of u32 token ids", reason="bad_rollout")
        if len(self.completion) % 4 or not self.completion:
            raise InvariantError(
                "completion must be a non-empty sequence of u32 token ids", reason="bad_rollout"
            )
        if len(self.logprobs) != len(self.completion):
            raise InvariantError("exactly one f32 log-prob per completion token", reason="bad_rollout")
        if self.proof and len(self.proof) != proof_size(len(self.completion) // 4):
            raise InvariantError(
                "proof must hold 258 bytes per started chunk of 32 completion tokens", reason="bad_rollout"
            )
        if any(t > _TOKEN_LIMIT for t in unpack_tokens(self.prompt) + unpack_tokens(self.completion)):
            raise InvariantError("token id out of range", reason="bad_rollout")
        for value in unpack_logprobs(self.logprobs):
            if not (math.isfinite(value) and value <= 0.0):
                raise InvariantError("log-probs must be finite and <= 0", reason="bad_rollout")

    def prompt_tokens(self) -> tuple[int, ...]:
        return unpack_tokens(self.prompt)

    def completion_tokens(self) -> tuple[int, ...]:
        return unpack_tokens(self.completion)

    def completion_logprobs(self) -> tuple[float, ...]:
        return unpack_logprobs(self.logprobs)


@message("rollout.batch", max_bytes=MAX_BATCH_BYTES)
@dataclass(frozen=True)
class RolloutBatch(Message):
    """A worker's batch for one schedule draw; ``samples`` are grouped: group g = samples[g*G:(g+1)*G]."""

    format_version: Annotated[int, IntRange(1, 1)]
    run_id: Annotated[str, MaxLen(64)]
    worker: Address
    policy_step: Annotated[int, IntRange(0, _U63)]
    batch_counter: Annotated[int, IntRange(0, _U63)]
    temperature: float
    group_size: Annotated[int, IntRange(1, 1024)]
    samples: Annotated[tuple[RolloutSample, ...], MaxLen(MAX_SAMPLES)]

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise InvariantError("temperature must lie in [0, 100]", reason="bad_rollout")
        if not self.samples or len(self.samples) % self.group_size:
            raise InvariantError("samples must be a non-empty whole number of groups", reason="bad_rollout")
        for start in range(0, len(self.samples), self.group_size):
            group = self.samples[start : start + self.group_size]
            if any(s.task_id != group[0].task_id for s in group):
                raise InvariantError("every sample of a group must share its task id", reason="bad_rollout")

    @property
    def groups(self) -> int:
        return len(self.samples) // self.group_size

    def group(self, index: int) -> tuple[RolloutSample, ...]:
        return self.samples[index * self.group_size : (index + 1) * self.group_size]
