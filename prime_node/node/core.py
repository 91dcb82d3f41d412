"""The running node's own parts, shared by the protocols it speaks itself (gossip, direct heartbeats).

One settings object instead of the same seven constructor arguments in every such class. Services do not
get this (it holds the nursery and the raw host): they get a ``NodeContext`` (prime_node/node/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from crypto.keys import WalletKey
from prime_node.node.clock import NodeClock
from prime_node.node.metrics import NodeMetrics
from prime_node.node.peers import PeerPolicy
from prime_node.p2p.interface import P2PHost


@dataclass(frozen=True)
class NodeCore:
    host: P2PHost
    key: WalletKey
    run_id: str
    clock: NodeClock
    metrics: NodeMetrics
    policy: PeerPolicy
    nursery: trio.Nursery
    """The node's nursery: background work (repairs, sends) ends with the node."""
