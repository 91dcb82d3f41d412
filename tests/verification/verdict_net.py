"""Three kinds of node on the in-memory network, for tests of what admission hands the trainer: a trainer
node running ``AdmissionService``, one node per validator key (it gossips verdicts the test signs or
judges itself, so the test knows each validator's secret sample) and the worker's node."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trio

from crypto.keys import WalletKey
from prime_node.config import RunConfig
from prime_node.node.service import Node
from prime_node.testing.memory_network import MemoryNetwork
from prime_node.verification.admission_service import AdmissionService
from prime_node.verification.batch_publish import VERDICTS_TOPIC
from prime_node.verification.reputation import ReputationService
from protocol.codec import encode
from protocol.envelope import Envelope
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until


@dataclass
class VerdictNet:
    trainer: Node
    admission: AdmissionService
    validators: list[Node]
    worker: Node


async def start_verdict_net(
    nursery: trio.Nursery,
    tmp_path: Path,
    run: RunConfig,
    validator_keys: list[WalletKey],
    worker_key: WalletKey,
) -> VerdictNet:
    host = MemoryNetwork().host
    admission = AdmissionService(run_config=run)
    trainer, _ = await start_node(
        nursery,
        host,
        make_config(tmp_path, 0, run_id=run.run_id),
        services=[admission],
        serve_api=False,
        write_node_file=False,
    )
    boot = (trainer.advertised_multiaddrs()[0],)
    others = []
    for index, key in enumerate([*validator_keys, worker_key], start=1):
        node, _ = await start_node(
            nursery,
            host,
            make_config(tmp_path, index, run_id=run.run_id, bootstrap=boot),
            key=key,
            services=[ReputationService(run_config=run)],
            serve_api=False,
            write_node_file=False,
        )
        others.append(node)
    nodes = [trainer, *others]
    await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=60)
    return VerdictNet(trainer, admission, others[:-1], others[-1])


async def publish_verdict(node: Node, envelope: Envelope) -> None:
    await node.gossip.publish(VERDICTS_TOPIC, encode(envelope))
