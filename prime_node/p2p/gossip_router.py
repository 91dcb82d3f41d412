"""py-libp2p's pubsub as the host runs it, with two per-message costs of an idle swarm taken out.

``SettlingGossipSub``: the gossipsub router, its heartbeat slowed once the mesh settles.

Each gossipsub heartbeat repairs the mesh and sends IHAVE (ids of the last few heartbeats' messages) to up
to 6 peers outside the mesh per topic. In an idle swarm that lazy gossip is most of what gossipsub sends:
at 1 s, ~6 small RPCs out and in per node per second whenever anything was published in the last 3 s,
each ~1 ms of CPU in py-libp2p. Publishing does not wait for the heartbeat (messages go to the mesh at
once), and our own gossip layer repairs gaps by sequence number (prime_node/node/gossip.py), so the
heartbeat runs every ``fast`` s only while a mesh is thin, overfull or changing, and every ``settled`` s
once each topic's mesh holds ``degree_low``..``degree_high`` peers (or every subscriber there is).

``LeanPubsub``: py-libp2p attaches the sender's signed peer record to every RPC it sends, and checks the
signature of the one on every RPC it receives (~10 % of an idle node's CPU with heartbeats on). The
record still goes once per stream, in the hello that opens it; later RPCs go without. Nothing of ours
reads py-libp2p's certified address book it feeds (our peers' signed records are our own, DESIGN §4).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from libp2p.abc import INetStream
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub


class SettlingGossipSub(GossipSub):
    """GossipSub whose heartbeat interval is ``fast`` until its meshes settle, then ``settled``."""

    def __init__(self, *args: Any, fast: float, settled: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fast_interval = fast
        self.settled_interval = settled
        self.heartbeat_interval = fast  # type: ignore[assignment]  # py-libp2p annotates it int; a float sleeps

    def mesh_heartbeat(self) -> tuple[defaultdict[ID, list[str]], defaultdict[ID, list[str]]]:
        grafts, prunes = super().mesh_heartbeat()
        settled = not grafts and not prunes and all(self._mesh_settled(topic) for topic in self.mesh)
        self.heartbeat_interval = self.settled_interval if settled else self.fast_interval  # type: ignore[assignment]
        return grafts, prunes

    def _mesh_settled(self, topic: str) -> bool:
        size = len(self.mesh[topic])
        subscribers = len(self.pubsub.peer_topics.get(topic, ())) if self.pubsub is not None else 0
        return min(self.degree_low, subscribers) <= size <= self.degree_high


class LeanPubsub(Pubsub):
    """Pubsub that sends the signed peer record in the stream's hello only (see the module doc)."""

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        if rpc_msg.HasField("senderRecord"):
            lean = rpc_pb2.RPC()
            lean.CopyFrom(rpc_msg)  # the caller may send the same RPC to other peers
            lean.ClearField("senderRecord")
            rpc_msg = lean
        return await super().write_msg(stream, rpc_msg)
