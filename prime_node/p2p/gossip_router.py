"""py-libp2p's pubsub as the host runs it, with one per-message cost of an idle swarm taken out and one
remote failure contained.

``LeanPubsub``: py-libp2p attaches the sender's signed peer record to every RPC it sends, and checks the
signature of the one on every RPC it receives (~10 % of an idle node's CPU with heartbeats on). The
record still goes once per stream, in the hello that opens it; later RPCs go without. Nothing of ours
reads py-libp2p's certified address book it feeds (our peers' signed records are our own, DESIGN §4).

Its stream handler also keeps a peer's malformed input to that peer's stream: py-libp2p 0.8.1 handles
stream and varint errors there but lets a protobuf ``DecodeError`` (an RPC that does not parse) escape,
and an error escaping a stream handler fails the whole host: any peer could stop any node with one
malformed RPC. Such a stream is reset and the peer dropped from pubsub, as for the errors py-libp2p
handles itself.
"""

from __future__ import annotations

import contextlib
import logging

from libp2p.abc import INetStream
from libp2p.pubsub.pb import rpc_pb2
from libp2p.pubsub.pubsub import Pubsub

log = logging.getLogger(__name__)


class LeanPubsub(Pubsub):
    """Pubsub that sends the signed peer record in the stream's hello only (see the module doc)."""

    async def write_msg(self, stream: INetStream, rpc_msg: rpc_pb2.RPC) -> bool:
        if rpc_msg.HasField("senderRecord"):
            lean = rpc_pb2.RPC()
            lean.CopyFrom(rpc_msg)  # the caller may send the same RPC to other peers
            lean.ClearField("senderRecord")
            rpc_msg = lean
        return await super().write_msg(stream, rpc_msg)

    async def stream_handler(self, stream: INetStream) -> None:
        try:
            await super().stream_handler(stream)
        except Exception as exc:  # whatever the peer's bytes make py-libp2p raise ends this stream only
            peer_id = stream.muxed_conn.peer_id
            log.info("resetting the pubsub stream of %s: %s", peer_id, type(exc).__name__)
            with contextlib.suppress(Exception):
                await stream.reset()
            self._handle_dead_peer(peer_id)
