"""Which tasks a worker draws, and the seed of every sample: a pure function a validator recomputes.

For a run seed ``S``, worker address ``W``, policy step ``P`` and batch counter ``B`` (the worker's own
count of batches made at that step), the draw is

    task_indices(W, P, B, S, pool_size, count): the first ``count`` *distinct* values of
        H("tasks", W, P, B, S, i) mod pool_size   for i = 0, 1, 2, ...
    sample_seed(W, P, B, S, g, j) = H("sample", W, P, B, S, g, j) >> 65   (its top 63 bits)

where g is the group (the g-th drawn task), j the sample within its group, and

    H(tag, W, P, B, S, *ints) = first 16 bytes, big-endian, of
        SHA-256("prime-node/schedule/v1/" ‖ tag ‖ 0x00 ‖ W(20 bytes) ‖ u64 P ‖ u64 B ‖ u64 S ‖ u64 each int)

Indices select from the task source's ordered training pool; the 128-bit hash makes modulo bias
negligible. A worker therefore cannot choose easy tasks or re-roll seeds until it likes a sample: the
validator recomputes both from the signed batch header.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

from crypto.keys import Address
from protocol.errors import LocalProtocolError

_TAG = b"prime-node/schedule/v1/"
_U64 = (1 << 64) - 1
MAX_DRAW = 1 << 16


def _check_u64(**values: int) -> None:
    for name, value in values.items():
        if not 0 <= value <= _U64:
            raise LocalProtocolError(
                f"schedule input {name}={value} is not a u64", reason="bad_schedule_input"
            )


def _hash(
    tag: bytes, worker: Address, policy_step: int, batch_counter: int, run_seed: int, *extra: int
) -> int:
    _check_u64(policy_step=policy_step, batch_counter=batch_counter, run_seed=run_seed)
    data = _TAG + tag + b"\x00" + worker.raw + struct.pack(">QQQ", policy_step, batch_counter, run_seed)
    data += b"".join(struct.pack(">Q", value) for value in extra)
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "big")


@dataclass(frozen=True)
class Draw:
    """One batch's schedule: the pool indices of its tasks and, per task, the seeds of its group."""

    task_indices: tuple[int, ...]
    seeds: tuple[tuple[int, ...], ...]


def task_indices(
    worker: Address, policy_step: int, batch_counter: int, run_seed: int, *, pool_size: int, count: int
) -> tuple[int, ...]:
    """``count`` distinct indices into a pool of ``pool_size`` tasks (see the module doc)."""
    if not 0 < count <= min(pool_size, MAX_DRAW):
        raise LocalProtocolError(
            f"cannot draw {count} distinct tasks from {pool_size}", reason="bad_schedule_input"
        )
    chosen: list[int] = []
    seen: set[int] = set()
    attempt = 0
    while len(chosen) < count:
        index = _hash(b"tasks", worker, policy_step, batch_counter, run_seed, attempt) % pool_size
        attempt += 1
        if index not in seen:
            seen.add(index)
            chosen.append(index)
    return tuple(chosen)


def sample_seed(
    worker: Address, policy_step: int, batch_counter: int, run_seed: int, group: int, sample: int
) -> int:
    """The 63-bit sampling seed of sample ``sample`` in group ``group`` of the batch."""
    _check_u64(group=group, sample=sample)
    return _hash(b"sample", worker, policy_step, batch_counter, run_seed, group, sample) >> 65


def draw(
    worker: Address,
    policy_step: int,
    batch_counter: int,
    run_seed: int,
    *,
    pool_size: int,
    groups: int,
    group_size: int,
) -> Draw:
    """The whole schedule of one batch: ``groups`` tasks, each sampled ``group_size`` times."""
    indices = task_indices(worker, policy_step, batch_counter, run_seed, pool_size=pool_size, count=groups)
    seeds = tuple(
        tuple(sample_seed(worker, policy_step, batch_counter, run_seed, g, j) for j in range(group_size))
        for g in range(groups)
    )
    return Draw(indices, seeds)
