"""Start real nodes (libp2p on 127.0.0.1) each running a SwarmService with a real data plane."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from crypto.keys import Address, WalletKey
from prime_node.node.service import Node
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.swarm.service import SwarmService, SwarmSettings
from tests.p2p.helpers import make_config, start_node

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


@dataclass
class Peer:
    node: Node
    swarm: SwarmService
    scope: trio.CancelScope


async def start_peer(
    nursery: trio.Nursery,
    tmp_path: Path,
    index: int,
    *,
    trainer: Address | None,
    key: WalletKey | None = None,
    bootstrap: tuple[str, ...] = (),
    **swarm_options: Any,
) -> Peer:
    key = key or WalletKey.generate()
    swarm = SwarmService(
        key=key,
        run_id="test",
        trainer=trainer,
        store_dir=tmp_path / f"store{index}",
        settings=SwarmSettings(**{"dataplane_host": "127.0.0.1", "seed": index, **swarm_options}),
    )
    config = make_config(tmp_path, index, bootstrap=bootstrap)
    node, scope = await start_node(nursery, OPEN, config, key=key, services=[swarm], serve_api=False)
    return Peer(node, swarm, scope)
