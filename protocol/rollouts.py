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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Annotated

import msgpack

from crypto.keys import ADDRESS_SIZE, Address
from protocol.codec import WIRE_VERSION, IntRange, MaxLen, Message, message
from protocol.errors import InvariantError, RemoteProtocolError

FORMAT_VERSION = 1
MAX_PROMPT_TOKENS = 8192
MAX_COMPLETION_TOKENS = 16384
MAX_SAMPLES = 4096
PROOF_CHUNK_TOKENS = 32
PROOF_CHUNK_BYTES = 258
MAX_BATCH_BYTES = 64 << 20  # an Envelope's payload cap: a batch is signed as one payload
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

    def only_groups(self, groups: Sequence[int]) -> RolloutBatch:
        """The same batch holding only ``groups`` (indices into this batch, kept in the order given);
        whole groups, so group-normalised advantages stay what they were."""
        if not groups or any(not 0 <= g < self.groups for g in groups) or len(set(groups)) != len(groups):
            raise InvariantError(
                f"groups {list(groups)[:8]} are not distinct groups of this batch", reason="bad_groups"
            )
        return replace(self, samples=tuple(s for g in groups for s in self.group(g)))


@dataclass(frozen=True)
class BatchHeader:
    """The scalar fields of a ``rollout.batch`` payload and its sample count, read without decoding a
    sample (``peek_header``): what a validator needs to refuse a batch of the wrong shape or size before
    it spends time proportional to the bytes."""

    run_id: str
    worker: Address
    policy_step: int
    batch_counter: int
    temperature: float
    group_size: int
    sample_count: int

    @property
    def groups(self) -> int:
        return self.sample_count // self.group_size

    @classmethod
    def of(cls, batch: RolloutBatch) -> BatchHeader:
        return cls(
            batch.run_id,
            batch.worker,
            batch.policy_step,
            batch.batch_counter,
            batch.temperature,
            batch.group_size,
            len(batch.samples),
        )


_HEADER_FIELDS = 8  # RolloutBatch's fields: seven scalars, then the samples array
_HEADER_BYTES = 1024  # the frame's start, the seven scalars and the samples array's header fit in this


def peek_header(payload: bytes) -> BatchHeader:
    """The header of a ``rollout.batch`` frame in O(1) work: only the payload's first kilobyte is read,
    the scalars are unpacked with limits that refuse any array or long string in their place, and the
    samples array contributes only its length. It validates nothing the full ``decode`` would not (a
    payload that peeks fine may still fail to decode); RemoteProtocolError ``malformed`` if the frame
    does not even start like a rollout batch."""
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=_HEADER_BYTES,
        max_str_len=256,
        max_bin_len=256,
        max_array_len=0,  # no array where a scalar belongs (array headers are read explicitly)
        max_map_len=0,
        max_ext_len=0,
    )
    try:
        unpacker.feed(payload[:_HEADER_BYTES])
        if unpacker.read_array_header() != 3 or unpacker.unpack() != WIRE_VERSION:
            raise ValueError("not a [version, type, body] frame")
        if unpacker.unpack() != RolloutBatch.TYPE or unpacker.read_array_header() != _HEADER_FIELDS:
            raise ValueError("not a rollout batch")
        version, run_id, worker, policy_step, batch_counter, temperature, group_size = (
            unpacker.unpack() for _ in range(_HEADER_FIELDS - 1)
        )
        sample_count = unpacker.read_array_header()
    except (ValueError, msgpack.OutOfData, msgpack.FormatError, msgpack.StackError) as exc:
        raise RemoteProtocolError(
            f"not a rollout batch frame: {type(exc).__name__}", reason="malformed"
        ) from exc
    ints = (version, policy_step, batch_counter, group_size)
    if (
        version != FORMAT_VERSION
        or type(run_id) is not str
        or type(worker) is not bytes
        or len(worker) != ADDRESS_SIZE
        or any(type(v) is not int or not 0 <= v <= _U63 for v in ints)
        or type(temperature) is not float
        or not 1 <= group_size <= 1024
    ):
        raise RemoteProtocolError("rollout batch header has a field of the wrong type", reason="malformed")
    return BatchHeader(
        run_id, Address(worker), policy_step, batch_counter, temperature, group_size, sample_count
    )
