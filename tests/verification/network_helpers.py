"""A small verification swarm for the network tests: an inferer (the scenario's worker key), validators
and a trainer-side admission node, on the memory network or on real libp2p hosts, with a real tiny
model whose policy checkpoint lies in a local directory written by prime_node.ml."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
import trio.testing

from crypto.keys import WalletKey
from prime_node.node.service import HostOpener, Node
from prime_node.testing.adversary import build_scenario
from prime_node.verification.cheating import Scenario
from prime_node.verification.service import (
    AdmissionService,
    ReputationService,
    ValidatorService,
    ValidatorSettings,
)
from protocol.scoring import ScoringConfig
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until

RUN_ID = "adversary"  # build_scenario's run id: nodes and run config must agree
LENIENT = ScoringConfig(ban_threshold=-1e12)  # for tests that send many bad batches from one worker


def fresh(scenario: Scenario) -> Scenario:
    """Seal from now on with the current wall clock (the nodes check envelope freshness against it)."""
    scenario.now_ms = time.time_ns() // 1_000_000
    return scenario


@asynccontextmanager
async def virtual_time_stands_still_in_threads() -> AsyncIterator[None]:
    """Under an autojump clock, real time spent in a worker thread (a validator building its judge, a
    model forward) lets the virtual clock race from timer to timer: 60–690 virtual seconds measured while
    one validator started on a loaded machine, so nodes started after it disagreed with the rest about
    the wall time by minutes (and refused each other's records), and a 5-s virtual deadline could pass
    inside one check. While any worker thread runs, the clock here does not jump; a test then measures
    the protocol, not how fast this machine was."""
    clock = trio.lowlevel.current_clock()
    if not isinstance(clock, trio.testing.MockClock):
        yield
        return
    real_run_sync = trio.to_thread.run_sync
    threshold = clock.autojump_threshold
    running = 0

    async def run_sync(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        nonlocal running
        running += 1
        clock.autojump_threshold = math.inf
        try:
            return await real_run_sync(function, *args, **kwargs)
        finally:
            running -= 1
            if not running:
                clock.autojump_threshold = threshold

    trio.to_thread.run_sync = run_sync  # type: ignore[assignment]
    try:
        yield
    finally:
        trio.to_thread.run_sync = real_run_sync


def make_scenario(trusted: list[WalletKey], *, quorum: int = 1) -> Scenario:
    scenario = build_scenario(
        trusted_validators=tuple(str(k.address) for k in trusted), verdict_quorum=quorum
    )
    return fresh(scenario)


def policy_dir(scenario: Scenario, root: Path) -> Path:
    from prime_node.ml.model import save_model_dir

    out = root / "policy"
    if not out.exists():
        save_model_dir(scenario.engine.model, scenario.tokenizer, out)
    return out


def locator(
    scenario: Scenario, directory: Path, gate: Callable[[], bool] = lambda: True
) -> Callable[[int], Path | None]:
    """What the weight swarm would answer: the checkpoint for every step within the async bound."""

    def locate(step: int) -> Path | None:
        low = scenario.current_step - scenario.config.async_level
        return directory if gate() and low <= step <= scenario.current_step else None

    return locate


@dataclass
class Swarm:
    scenario: Scenario
    inferer: Node
    trainer: Node
    admission: AdmissionService | None
    validators: list[tuple[Node, ValidatorService]] = field(default_factory=list)
    others: list[Node] = field(default_factory=list)

    @property
    def nodes(self) -> list[Node]:
        return [self.inferer, self.trainer, *(n for n, _ in self.validators), *self.others]


async def start_swarm(
    nursery: trio.Nursery,
    opener: HostOpener,
    tmp_path: Path,
    scenario: Scenario,
    validator_keys: list[WalletKey],
    *,
    scoring: ScoringConfig | None = None,
    validator_kwargs: dict[int, dict[str, Any]] | None = None,
    observers: int = 0,
    admission: bool = True,
    serve_api: bool = False,
) -> Swarm:
    """Trainer first (the bootstrap), then validators, observers (reputation only) and the inferer."""
    directory = policy_dir(scenario, tmp_path)
    run = scenario.config
    kwargs: dict[str, Any] = {"serve_api": serve_api, "write_node_file": False}
    if scoring is not None:
        kwargs["scoring"] = scoring
    intake = AdmissionService(run_config=run) if admission else None
    trainer, _ = await start_node(
        nursery,
        opener,
        make_config(tmp_path, 0, run_id=RUN_ID),
        services=[intake] if intake else [ReputationService(run_config=run)],
        **kwargs,
    )
    boot = trainer.advertised_multiaddrs()[0]
    swarm = Swarm(scenario, trainer, trainer, intake)
    for i, key in enumerate(validator_keys):
        reputation = ReputationService(run_config=run)
        extra = (validator_kwargs or {}).get(i, {})
        service = ValidatorService(
            key=key,
            run_config=run,
            locate=extra.pop("locate", locator(scenario, directory)),
            current_step=lambda: scenario.current_step,
            reputation=reputation,
            settings=ValidatorSettings(**{"poll_s": 0.1, **extra}),
        )
        node, _ = await start_node(
            nursery,
            opener,
            make_config(tmp_path, 1 + i, run_id=RUN_ID, bootstrap=(boot,)),
            key=key,
            services=[reputation, service],
            **kwargs,
        )
        swarm.validators.append((node, service))
    for j in range(observers):
        node, _ = await start_node(
            nursery,
            opener,
            make_config(tmp_path, 50 + j, run_id=RUN_ID, bootstrap=(boot,)),
            services=[ReputationService(run_config=run)],
            **kwargs,
        )
        swarm.others.append(node)
    swarm.inferer, _ = await start_node(
        nursery,
        opener,
        make_config(tmp_path, 99, run_id=RUN_ID, bootstrap=(boot,)),
        key=scenario.key,
        services=[ReputationService(run_config=run)],
        **kwargs,
    )
    nodes = swarm.nodes
    await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=60)
    return swarm


async def judged(service: ValidatorService, batch_id: bytes, timeout: float = 60) -> tuple[str, ...]:
    """Wait until ``service`` has judged the batch; its reasons (empty: accepted)."""
    await wait_until(lambda: any(j.batch_id == batch_id for j in service.recent), timeout=timeout)
    return next(j.reasons for j in service.recent if j.batch_id == batch_id)
