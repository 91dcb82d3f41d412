"""A stopping inferer or validator does not wait for its model work (issue 36): with a real-size model a
generation or a prefill runs for many seconds in a worker thread, and SIGTERM/Ctrl-C (or a role switch)
waited for it, up to the node's 5 s shutdown watchdog. Now the cancelled service returns while its thread
is still busy (abandoned), and the thread's model work ends at its next forward pass.

Real services, the real tiny model and engine; the work blocks on an event nobody sets (a safety timer
sets it long after, so that the old code, which waited for the thread, ends and fails instead of
hanging). Order of events, no time bounds."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio

pytest.importorskip("torch")

from crypto.keys import WalletKey
from prime_node.ml.engine import SamplingParams
from prime_node.node.context import NodeContext
from prime_node.roles.inferer_service import InfererService
from prime_node.testing.adversary import build_scenario
from prime_node.verification.model_threads import ModelWorkStoppedError
from prime_node.verification.service import ValidatorService, _Queued
from protocol.codec import decode
from protocol.envelope import Envelope
from protocol.rollouts import RolloutBatch
from tests.one_policy import OnePolicy

SAFETY_S = 60.0
"""When a safety timer frees blocked work (the test takes ~1 s): only the old code waits that long."""
GUARD_S = 10 * SAFETY_S


def _safety(never: threading.Event) -> None:
    timer = threading.Timer(SAFETY_S, never.set)
    timer.daemon = True
    timer.start()


class _Gossip:
    async def publish(self, topic: str, payload: bytes) -> None:
        pass


def _context(now_ms: int) -> NodeContext:
    return cast(NodeContext, SimpleNamespace(clock=SimpleNamespace(wall_ms=lambda: now_ms), gossip=_Gossip()))


class _Endless:
    """A rollout producer that generates (real forward passes of the engine) until ``never`` is set."""

    adversary: str | None = None

    def __init__(self, *, forward: bool) -> None:
        self.forward = forward
        self.never = threading.Event()
        self.entered = threading.Event()
        self.left = threading.Event()
        self.ended_by: BaseException | None = None
        _safety(self.never)

    def frames(self, *, engine: Any, tokenizer: Any, task: Any, **_: Any) -> list[bytes]:
        self.entered.set()
        try:
            while not self.never.wait(0.01 if self.forward else None):
                engine.generate([[1, 2, 3]], [0], SamplingParams(max_new_tokens=4))
        except BaseException as exc:
            self.ended_by = exc
            raise
        finally:
            self.left.set()
        return []


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    from prime_node.ml.model import save_model_dir

    scenario = build_scenario()
    out = tmp_path_factory.mktemp("policy")
    save_model_dir(scenario.engine.model, scenario.tokenizer, out)
    return scenario, out


async def _cancel_inferer_while_generating(producer: _Endless, scenario: Any, path: Path) -> InfererService:
    inferer = InfererService(
        key=WalletKey.generate(),
        run_config=scenario.config,
        swarm=OnePolicy(scenario.current_step, path),
        producer=producer,
        threads=1,
    )
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(inferer._produce, _context(scenario.now_ms))
            await trio.to_thread.run_sync(producer.entered.wait)
            nursery.cancel_scope.cancel()
    return inferer


async def test_a_cancelled_inferer_leaves_its_generation_and_the_generation_stops(
    policy: tuple[Any, Path],
) -> None:
    scenario, path = policy
    producer = _Endless(forward=True)
    inferer = await _cancel_inferer_while_generating(producer, scenario, path)
    assert not producer.left.is_set()  # returned while its thread was still generating: abandoned
    assert inferer.model.stop.is_set()
    with trio.fail_after(GUARD_S):
        await trio.to_thread.run_sync(producer.left.wait)
    assert isinstance(producer.ended_by, ModelWorkStoppedError)  # stopped at a forward pass, not by `never`
    assert not producer.never.is_set()
    producer.never.set()


async def test_a_cancelled_inferer_does_not_wait_for_work_that_never_returns(
    policy: tuple[Any, Path],
) -> None:
    """Work that makes no forward pass is not stopped, only left: the service returns all the same."""
    scenario, path = policy
    producer = _Endless(forward=False)
    await _cancel_inferer_while_generating(producer, scenario, path)
    assert producer.entered.is_set() and not producer.left.is_set()
    producer.never.set()


async def test_a_cancelled_validator_leaves_its_prefill_and_stops_its_engines(
    policy: tuple[Any, Path],
) -> None:
    scenario, path = policy
    frame = scenario.honest_frames(1)[0]
    envelope = decode(frame, Envelope)
    step = decode(envelope.payload, RolloutBatch).policy_step
    service = ValidatorService(
        key=WalletKey.generate(),
        run_config=scenario.config,
        locate=lambda s: path if s == step else None,
        current_step=lambda: scenario.current_step,
    )
    await trio.to_thread.run_sync(service._judge.build, service.domain, service.window)
    assert await service.preload(step)
    never, entered, left = threading.Event(), threading.Event(), threading.Event()
    _safety(never)

    def block(module: Any, args: Any) -> None:  # the prefill's forward pass, held
        entered.set()
        try:
            never.wait()
        finally:
            left.set()

    engine = service._judge.engine(step)
    assert engine is not None
    engine.model.get_decoder().register_forward_pre_hook(block)
    item = _Queued(frame, envelope.signer, "peer", step, trio.current_time())
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service._validate, _context(scenario.now_ms), item)
            await trio.to_thread.run_sync(entered.wait)
            nursery.cancel_scope.cancel()
    assert not left.is_set() and service.counts["validated"] == 0  # returned mid-prefill: abandoned
    assert service._judge.stop.is_set()
    never.set()
    with pytest.raises(ModelWorkStoppedError):  # every further forward pass of its engines is refused
        engine.prefill([[1, 2]], [[3]])
