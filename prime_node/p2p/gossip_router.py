"""py-libp2p's pubsub as the host runs it, with one per-message cost of an idle swarm taken out.

``LeanPubsub``: py-libp2p attaches the sender's signed peer record to every RPC it sends, and checks the
signature of the one on every RPC it receives (~10 % of an idle node's CPU with heartbeats on). The
record still goes once per stream, in the hello that opens it; later RPCs go without. Nothing of ours
reads py-libp2p's certified address book it feeds (our peers' signed records are our own, DESIGN §4).
"""

from __future__ import annotations

from libp2p.abc import INetStream
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub


class LeanPubsub(Pubsub):
    """Pubsub that sends the signed peer record in the stream's hello only (see the module doc)."""

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        if rpc_msg.HasField("senderRecord"):
            lean = rpc_pb2.RPC()
            lean.CopyFrom(rpc_msg)  # the caller may send the same RPC to other peers
            lean.ClearField("senderRecord")
            rpc_msg = lean
        return await super().write_msg(stream, rpc_msg)
