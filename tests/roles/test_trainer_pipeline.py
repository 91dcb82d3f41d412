"""Issue 38 item 2, no idle trainer: the networked trainer's step loop waits for neither its publication
nor its admission.

A real ``TrainerService`` with its real ``TrainingSession`` on the tiny model, real batches (``make_batch``;
a length reward makes a random model's groups informative), handed in as accepted by a stand-in for
admission. The weight swarm is a stand-in whose ``publish`` can be held on an event: while policy 1 is
being shared, the next steps train anyway; the policies shared are the very bytes each step produced
(the next optimizer step ran in between); the newest policy is shared, the last one before the run is
done, and every delta is against a policy that was shared. Ordering is forced with events, never timed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from safetensors.torch import load as load_safetensors

from crypto.keys import Address, WalletKey
from prime_node.config import RunConfig
from prime_node.ml.engine import TorchEngine
from prime_node.ml.model import load_model
from prime_node.ml.rollout_batch import LOCAL_WORKER, make_batch
from prime_node.ml.session import TrainingSession
from prime_node.ml.tokenizer import load_tokenizer
from prime_node.node.stage_times import StageTimes
from prime_node.roles.trainer_publisher import PolicyPublisher, Timing
from prime_node.roles.trainer_service import TrainerOptions, TrainerService
from prime_node.swarm.delta_versions import Published
from prime_node.tasks.factory import build_task
from prime_node.verification.inbox.pending import PendingBatches
from protocol.demand import Heard
from protocol.manifest import Manifest, build_manifest
from protocol.rollouts import RolloutBatch
from tests.p2p.helpers import wait_until

INFORMATIVE = (3, 5, 10)
"""Batch counters whose batches of the tiny model (seed 0) hold informative groups under this recipe."""
SIGNER = WalletKey.generate().address
GUARD_S = 120  # hang guard: a step of the tiny model takes well under a second


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prime_node.ml.model import create_tiny_model, save_model_dir

    torch.set_num_threads(1)
    model, tokenizer = create_tiny_model(seed=0)
    out = tmp_path_factory.mktemp("tiny")
    save_model_dir(model, tokenizer, out)
    return out


def _config(tmp_path: Path, model: Path, key: WalletKey, max_steps: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model_dir": str(model),
            "output_dir": str(tmp_path / "out"),
            "trainer_address": str(key.address),
            "max_steps": max_steps,
            "group_size": 4,
            "prompts_per_step": 3,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "async_level": 2,
            "learning_rate": 3e-3,
            "eval_tasks": 8,
            "length_reward": {"coef": 1.0, "target_tokens": 3},
        }
    )


@pytest.fixture(scope="module")
def batches(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[RolloutBatch]:
    """Three batches of the base policy (step 0), one per step."""
    config = _config(tmp_path_factory.mktemp("recipe"), tiny_model_dir, WalletKey.generate(), 3)
    tokenizer = load_tokenizer(tiny_model_dir)
    engine = TorchEngine(
        load_model(tiny_model_dir), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    task = build_task(config.task)
    return [
        make_batch(engine, task, tokenizer, config, worker=LOCAL_WORKER, policy_step=0, batch_counter=c)
        for c in INFORMATIVE
    ]


class _Admission:
    """Hands the trainer the batches the test sends, as accepted."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[Any](8)

    async def next_accepted(self) -> Any:
        return await self.receive.receive()

    async def accept(self, batch: RolloutBatch) -> None:
        await self.send.send(SimpleNamespace(batch=batch, worker="worker"))


class _Context:
    """The two things ``TrainerService.run`` asks of its node."""

    def __init__(self) -> None:
        self.sections: dict[str, Any] = {}

    def add_record_source(self, source: Any) -> None:
        return None

    def add_status_section(self, name: str, section: Any) -> None:
        self.sections[name] = section


class _HeldSwarm:
    """Records each publish; ``hold[step]`` keeps that step's publish waiting until it is set. The
    policy's bytes are read when the swarm would hash them: after the wait."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, Path, Path | None, bool]] = []
        self.hold: dict[int, trio.Event] = {}
        self.sharing: int | None = None
        self.shared_bytes: dict[int, bytes] = {}

    async def publish(
        self,
        directory: Path,
        *,
        step: int,
        delta_base: Path | None = None,
        snapshot: bool = False,
        max_delta_share: float = 0.5,
    ) -> Published:
        self.calls.append((step, directory, delta_base, snapshot))
        self.sharing = step
        if step in self.hold:
            await self.hold[step].wait()
        self.shared_bytes[step] = (directory / "model.safetensors").read_bytes()
        self.sharing = None
        full = _manifest(step)
        return Published(
            full=full, delta=None, full_bytes=1000, delta_bytes=0, encode_seconds=0.0, reason="snapshot"
        )


def _manifest(step: int) -> Manifest:
    return build_manifest(
        run="run", step=step, piece_size=1024, files=[("a", 1)], piece_hashes=b"\0" * 32, signer=SIGNER
    )


def _live_weights(session: TrainingSession) -> dict[str, torch.Tensor]:
    """The training model's weights now, in the published dtype (what the step's policy file holds)."""
    from torch.distributed.tensor import DTensor

    dtype = getattr(torch, session.config.published_dtype)
    out = {}
    for name, tensor in session.trainer.model.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        out[name] = full.detach().to(dtype).clone() if full.is_floating_point() else full.detach().clone()
    return out


def _service(
    tmp_path: Path, model: Path, max_steps: int, swarm: _HeldSwarm, admission: _Admission
) -> TrainerService:
    key = WalletKey.generate()
    return TrainerService(
        key=key,
        run_config=_config(tmp_path, model, key, max_steps),
        swarm=swarm,
        admission=admission,
        options=TrainerOptions(stop_when_done=True, evaluate=False, fill_wait_s=0.0, demand=False),
    )


async def test_steps_train_while_a_policy_is_shared_and_what_is_shared_is_what_each_step_made(
    tmp_path: Path, tiny_model_dir: Path, batches: list[RolloutBatch]
) -> None:
    swarm, admission = _HeldSwarm(), _Admission()
    swarm.hold[1] = trio.Event()
    service = _service(tmp_path, tiny_model_dir, 3, swarm, admission)
    produced: dict[int, dict[str, torch.Tensor]] = {}

    def on_step(metrics: Any) -> None:  # before the next step starts: the model is this step's policy
        assert service.session is not None
        produced[metrics.step] = _live_weights(service.session)

    service.on_step = on_step
    done_with: list[list[int]] = []

    async def watch_done() -> None:
        await service.done.wait()
        done_with.append([call[0] for call in swarm.calls if call[0] in swarm.shared_bytes])

    try:
        with trio.fail_after(GUARD_S * 3):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_done)
                await nursery.start(service.run, _Context())
                await admission.accept(batches[0])
                await wait_until(lambda: swarm.sharing == 1, GUARD_S)
                # policy 1 is being shared (held): steps 2 and 3 train meanwhile
                await admission.accept(batches[1])
                await wait_until(lambda: service.step == 2, GUARD_S)
                await admission.accept(batches[2])
                await wait_until(lambda: service.step == 3, GUARD_S)
                assert swarm.sharing == 1 and [c[0] for c in swarm.calls] == [0, 1]
                # the demand speaks of the step trained, its policy not out yet: wanted once it is
                step, floor, wanted, _, _ = service.demand_now()
                assert (step, floor) == (3, 1) and wanted[-1] == 1
                swarm.hold[1].set()
    finally:
        service.close()

    # the newest policy (3) replaced 2, which was never started; 3 is a delta against 1, the last shared
    steps = [call[0] for call in swarm.calls]
    assert steps == [0, 1, 3]
    directory = {step: path for step, path, _, _ in swarm.calls}
    assert swarm.calls[2][2] == directory[1] and not swarm.calls[2][3]
    assert swarm.calls[0][2] is None and swarm.calls[0][3]  # the first policy: a full snapshot
    assert done_with == [[0, 1, 3]]  # the last policy was shared before the run was done
    assert service.checkpoints_shared == 3 and service.publisher.skipped == 1
    assert service.status()["publishing"]["newest"] == 3
    # what was shared is what each step made, though later steps trained before it was read
    for step in (1, 3):
        shared = load_safetensors(swarm.shared_bytes[step])
        assert shared and all(torch.equal(tensor, produced[step][name]) for name, tensor in shared.items())
    assert any(not torch.equal(produced[1][name], produced[3][name]) for name in produced[1])


async def test_the_next_steps_batches_are_admitted_while_a_step_trains(
    tmp_path: Path, tiny_model_dir: Path, batches: list[RolloutBatch]
) -> None:
    swarm, admission = _HeldSwarm(), _Admission()
    service = _service(tmp_path, tiny_model_dir, 2, swarm, admission)
    entered, release = threading.Event(), threading.Event()
    train = service._train

    def held_train(queued: Any) -> Any:  # the first step stays in training until released
        if not entered.is_set():
            entered.set()
            release.wait(GUARD_S * 3)
        return train(queued)

    service._train = held_train  # type: ignore[method-assign]
    try:
        with trio.fail_after(GUARD_S * 3):
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run, _Context())
                try:
                    await admission.accept(batches[0])
                    await wait_until(entered.is_set, GUARD_S)
                    await admission.accept(batches[1])
                    await wait_until(lambda: service.batches_accepted == 2, GUARD_S)
                    assert service.step == 0 and len(service.gatherer) == 1  # queued while step 1 trains
                finally:
                    release.set()  # the worker thread cannot be cancelled: let it end
    finally:
        service.close()
    assert service.step == 2 and service.batches_trained == 2
    assert swarm.calls[0][0] == 0 and swarm.calls[-1][0] == 2  # the last policy shared before the end


async def test_batches_arriving_older_make_the_trainer_want_a_shallower_queue(
    tmp_path: Path, tiny_model_dir: Path, batches: list[RolloutBatch]
) -> None:
    """Issue 38: the demand's depth follows the batches' round trip. Three batches of policy 0 reach the
    trainer at steps 0, 1 and 2 (ages 0, 1, 2; ``async_level`` 2): a batch of the typical age (1) behind a
    queue of two steps would be trained at age 3, past the bound, so the trainer now wants one step's worth
    (the fixed depth wanted two)."""
    swarm, admission = _HeldSwarm(), _Admission()
    service = _service(tmp_path, tiny_model_dir, 3, swarm, admission)

    def trained(step: int) -> Callable[[], bool]:
        return lambda: service.step == step

    try:
        with trio.fail_after(GUARD_S * 3):
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run, _Context())
                for step, batch in enumerate(batches, start=1):
                    await admission.accept(batch)
                    await wait_until(trained(step), GUARD_S)
    finally:
        service.close()
    step, floor, wanted, _, fresh = service.demand_now()
    assert (step, floor) == (3, 1)
    assert (wanted, fresh) == ((0, 0, 1), 1)  # the newest policy only
    ages = service.status()["ages"]
    assert ages["arrival"] == {0: 1, 1: 1, 2: 1} and ages["trained"] == {0: 1, 1: 1, 2: 1}


async def test_a_skipped_policy_moves_the_next_snapshot_to_the_first_policy_shared_after_it(
    tmp_path: Path,
) -> None:
    """Snapshots every 3 steps: 3 is skipped (newest wins), so 4 is the snapshot; deltas are always
    against the policy shared last."""
    config = RunConfig.model_validate({"run_id": "run", "delta_snapshot_every": 3, "delta_max_share": 0.25})
    swarm = _HeldSwarm()
    directories = {step: tmp_path / f"step_{step}" for step in range(8)}
    for directory in directories.values():
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"weights")
    publisher = PolicyPublisher(
        config=config, swarm=swarm, write=directories.__getitem__, timing=Timing(), stages=StageTimes()
    )
    for step in (0, 1, 2, 4, 5, 7):
        await publisher.share(directories[step], step)
    assert [(step, base, snapshot) for step, _, base, snapshot in swarm.calls] == [
        (0, None, True),
        (1, directories[0], False),
        (2, directories[1], False),
        (4, directories[2], True),
        (5, directories[4], False),
        (7, directories[5], True),
    ]
    assert publisher.newest == 7 and publisher.shared == 6


def test_a_policy_file_pruned_between_the_look_and_the_link_is_linked_from_where_it_still_is(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The publisher writes a policy beside the next step, whose staging pruning may remove the file it
    found: it looks once more (the policy's checkpoint) instead of failing."""
    service = _service(tmp_path, tiny_model_dir, 1, _HeldSwarm(), _Admission())
    session = service.session = service._open()
    try:
        found = session.policy_file
        looks: list[int] = []

        def pruned_after_the_first_look(step: int) -> Path:
            looks.append(step)
            return tmp_path / "pruned.safetensors" if len(looks) == 1 else found(step)

        session.policy_file = pruned_after_the_first_look  # type: ignore[method-assign]
        directory = service._write_policy(0)
        assert looks == [0, 0]
        assert (directory / "model.safetensors").read_bytes() == found(0).read_bytes()
    finally:
        service.close()


class _DemandContext(_Context):
    """``_Context`` with the gossip and clock the demand publisher uses."""

    def __init__(self) -> None:
        super().__init__()
        self.published: list[bytes] = []

        async def subscribe(topic: str, handler: Any) -> None:
            return None

        async def publish(topic: str, payload: bytes) -> None:
            self.published.append(payload)

        self.gossip = SimpleNamespace(subscribe=subscribe, publish=publish)
        self.clock = SimpleNamespace(wall_ms=lambda: 1_700_000_000_000)


class _HeardAdmission(_Admission):
    """Admission that also hears batches announced before their verdicts, with the real bounded count
    (``PendingBatches``) the ``AdmissionService`` keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.pending = PendingBatches(per_worker=4)
        self.on_change: Callable[[], None] | None = None
        self.changes = 0

    def pending_by_policy(self) -> dict[int, int]:
        return dict(self.pending.by_policy(trio.current_time()))

    def heard_marks(self, most: int) -> tuple[tuple[Address, int], ...]:
        return self.pending.marks(most)

    def hear(self, batch_id: bytes, worker: Address, policy_step: int, counter: int) -> None:
        self.pending.vouched(worker)  # as if one of its batches had been accepted before
        self.pending.heard(batch_id, worker, policy_step, counter, trio.current_time())
        self.changes += 1
        if self.on_change is not None:
            self.on_change()


async def test_the_demand_counts_batches_heard_announced_before_their_verdicts(
    tmp_path: Path, tiny_model_dir: Path, batches: list[RolloutBatch]
) -> None:
    """Issue 38: each inferer used to count only its own batches on their way, and two filled the same
    room before either heard of the other's. Now the trainer counts every batch its admission heard
    announced as had (and names each worker's newest counter heard): the count is exact."""
    swarm, admission = _HeldSwarm(), _HeardAdmission()
    key = WalletKey.generate()
    service = TrainerService(
        key=key,
        run_config=_config(tmp_path, tiny_model_dir, key, 3),
        swarm=swarm,
        admission=admission,
        options=TrainerOptions(stop_when_done=True, evaluate=False, fill_wait_s=0.0, demand=True),
    )
    assert service.demand is not None
    worker = WalletKey.generate().address
    context = _DemandContext()
    try:
        with trio.fail_after(GUARD_S * 3):
            async with trio.open_nursery() as nursery:
                await nursery.start(service.run, context)
                for step, batch in enumerate(batches, start=1):  # ages 0, 1, 2: one step's worth wanted
                    await admission.accept(batch)
                    await wait_until(lambda step=step: service.step == step, GUARD_S)
    finally:
        service.close()
    assert context.published  # the demand was gossiped meanwhile
    step, floor, wanted, _, fresh = service.demand_now()
    assert (step, floor, wanted, fresh) == (3, 1, (0, 0, 1), 1)
    assert service.demand.make(1).heard == ()
    # an inferer's batch of policy 3 is announced: had, before any verdict on it
    admission.hear(b"b" * 32, worker, 3, 42)
    _, _, wanted, _, fresh = service.demand_now()
    # policy 3 is had; the room it leaves goes to others: heard batches never take the last step's worth of
    # room (a key announcing batches it never sends cannot starve the trainer)
    assert (wanted, fresh) == ((0, 1, 0), 1)
    assert service.demand.make(2).heard == (Heard(worker, 42),)
    assert service.demand._changed.is_set()  # published soon (rate limited)
    # the validators refused it: wanted again
    admission.pending.settled(b"b" * 32)
    assert service.demand_now()[2] == (0, 0, 1)
