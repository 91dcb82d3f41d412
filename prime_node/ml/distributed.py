"""torch.distributed for the trainer: process-group setup under torchrun (or a 1-rank group in-process),
and the few collectives the training session uses besides FSDP2's own (``fsdp.py``): rank 0's step
broadcast and summed metrics. gloo on CPU, NCCL on CUDA. Each rank's device comes from the one device
policy (``prime_node.hardware.select_device``): rank LOCAL_RANK takes the LOCAL_RANK-th GPU that ``--gpu``
selects; ``--gpu none`` trains on the CPU.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from prime_node.errors import NodeError
from prime_node.hardware import GpuSelection, probe, select_device

if TYPE_CHECKING:
    from prime_node.config import RunConfig

SHARED_MARK = ".prime-node-shared-storage-check"
"""The file rank 0 writes into the output directory for every node's ranks to find (multi-node)."""
NODE_LOCAL_FIELDS = frozenset({"model_dir", "output_dir", "trainer_address"})
"""Run-config fields that may differ between nodes: paths (mount points differ) and the trainer address
(filled in from the key on node 0 only). Every other field must be rank 0's."""


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        import torch.distributed as dist

        keys = sorted(values)
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return dict(zip(keys, tensor.tolist(), strict=True))

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None); empty data costs one collective."""
        import torch.distributed as dist

        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if int(size.item()) == 0:
            return b""
        if self.is_main and data is not None:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=0)
        return bytes(buffer.cpu().numpy().tobytes())

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def init_from_env(gpus: GpuSelection | None = None) -> DistInfo:
    """This process's device (``select_device`` for rank LOCAL_RANK of ``gpus``, default auto) and the
    process group torchrun describes in the environment; a single process needs none."""

    selection = gpus or GpuSelection("auto")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = select_device(probe(selection), selection, rank=local)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(device=device)
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device)


def ensure_process_group(info: DistInfo, device: str) -> None:
    """FSDP2 and torch.distributed.checkpoint need a process group even in one process: create a 1-rank
    one in-process (a HashStore: nothing listens) when there is none. Idempotent, so many sessions in
    one process (tests) share it; under torchrun ``init_from_env`` has made the real one already."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import HashStore

    if dist.is_initialized():
        if dist.get_world_size() != info.world_size:
            raise NodeError(
                f"a process group of {dist.get_world_size()} ranks exists, the trainer expects "
                f"{info.world_size}",
                reason="bad_config",
            )
        return
    if info.world_size != 1:
        raise NodeError("join the torchrun process group (init_from_env) first", reason="bad_config")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend=backend, store=HashStore(), rank=0, world_size=1)


def spans_machines(info: DistInfo) -> bool:
    """Whether this process group has ranks on other machines (torchrun's LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)) < info.world_size


def run_digest(run: RunConfig) -> str:
    """What every node's run config must agree on: all but ``NODE_LOCAL_FIELDS`` and the task file's
    path (only rank 0 reads it)."""
    document = json.loads(run.model_dump_json())
    shared = {name: value for name, value in document.items() if name not in NODE_LOCAL_FIELDS}
    if isinstance(shared.get("task"), dict):
        shared["task"] = {name: value for name, value in shared["task"].items() if name != "path"}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()


def check_same_run(run: RunConfig, dist: DistInfo) -> None:
    """Across nodes: every rank trains rank 0's run (same config but paths) and sees the output
    directory rank 0 writes (rank 0 leaves a file there for the others to read). Every rank learns
    whether any failed, so all stop together with NodeError ``bad_config`` instead of hanging."""
    mark = run.output_dir / SHARED_MARK
    nonce = os.urandom(16).hex()
    if dist.is_main:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        mark.write_text(nonce, encoding="utf-8")
    expected = json.loads(
        dist.broadcast_bytes(json.dumps([run_digest(run), nonce]).encode() if dist.is_main else None)
    )
    problems = []
    if run_digest(run) != expected[0]:
        problems.append("its run config differs from rank 0's (only its paths may)")
    try:
        seen = mark.read_text(encoding="utf-8")
    except OSError:
        seen = None
    if seen != expected[1]:
        problems.append(
            f"it does not see rank 0's output directory at {run.output_dir}: checkpoints of a multi-node "
            "run need one directory every node shares (a network file system)"
        )
    failed = dist.sum_floats({"failed": float(bool(problems))})["failed"]
    dist.barrier()
    if dist.is_main:
        mark.unlink(missing_ok=True)
    if problems:
        raise NodeError(f"rank {dist.rank}: " + "; ".join(problems), reason="bad_config")
    if failed:
        raise NodeError(
            "another rank's run config or output directory differs (its error says how)", reason="bad_config"
        )


def shutdown(*, together: bool = True) -> None:
    """Leave the process group (after a barrier when ``together``: every rank finished normally) and
    tear it down while the interpreter is fully alive. A rank that failed passes ``together=False``:
    its peers may never reach the barrier; torchrun stops them when it exits.

    gloo's worker threads drop their references to finished collectives (tensors owned by Python)
    asynchronously; if that happens during interpreter finalization the thread cannot take the GIL and
    the process dies with SIGABRT ("terminate called without an active exception", torch issue
    #190489). Callers that exit right after should use ``exit_process``.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()  # no rank tears down while another still talks to it
        dist.destroy_process_group()
        gc.collect()


def exit_process(code: int) -> None:
    """Flush everything and leave without interpreter finalization (see ``shutdown``): a torchrun
    worker's exit status must say whether training succeeded, not whether a torch thread lost a race."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
