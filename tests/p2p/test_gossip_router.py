"""Pubsub without the signed peer record on every RPC (prime_node/p2p/gossip_router.py)."""

from __future__ import annotations

from prime_node.p2p.gossip_router import LeanPubsub


class _Stream:
    """Collects what Pubsub.write_msg writes (one varint-prefixed RPC per write)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


async def test_rpcs_after_the_hello_go_without_the_signed_peer_record() -> None:
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.utils.varint import decode_varint_with_size

    pubsub = object.__new__(LeanPubsub)  # write_msg needs no pubsub state on success
    rpc = rpc_pb2.RPC(publish=[rpc_pb2.Message(data=b"manifest", topicIDs=["t"])], senderRecord=b"r" * 300)
    streams = [_Stream(), _Stream()]
    for stream in streams:  # one RPC object sent to several peers, as gossipsub does
        assert await pubsub.write_msg(stream, rpc)  # type: ignore[arg-type]
    for stream in streams:
        (frame,) = stream.writes
        length, size = decode_varint_with_size(frame)
        sent = rpc_pb2.RPC.FromString(frame[size : size + length])
        assert not sent.HasField("senderRecord")
        assert sent.publish[0].data == b"manifest"
    assert rpc.senderRecord == b"r" * 300  # the caller's RPC is left as it was
