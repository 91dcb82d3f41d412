"""The inferer's side of verification's two gossip topics (named in protocol/topics.py): seal and publish.

A sealed batch frame up to ``INLINE_LIMIT`` bytes rides gossip whole, as it always did: one gossip
message, no channel handshake or extra round trip per receiver, and every tool that reads the topic keeps
working. A bigger one (up to the run's ``max_rollout_batch_bytes``) is held by the node's
``BatchTransfer`` and only its ``RolloutAnnouncement`` (id, size, run, worker, policy step, counter, data-
plane port) is gossiped; validators and the trainer fetch the bytes over the data plane and check them
against the id (docs/verification.md, *Rollout batches over the data plane*). ``inline_limit=0`` sends
every batch that way. The gossip cap (``MAX_GOSSIPED_BATCH``, 256 KiB) now bounds announcements and
inline frames only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.verification.proving import seal_batch
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.errors import ProtocolError
from protocol.gossip_sequence import MAX_GOSSIP_PAYLOAD
from protocol.rollout_transfer import announcement_for
from protocol.rollouts import RolloutBatch, peek_header
from protocol.topics import ROLLOUTS_TOPIC, VERDICTS_TOPIC

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext
    from prime_node.node.service import Node
    from prime_node.verification.batch_transfer import BatchTransfer

__all__ = [  # the topics are re-exported: services import them from here
    "INLINE_LIMIT",
    "MAX_GOSSIPED_BATCH",
    "ROLLOUTS_TOPIC",
    "VERDICTS_TOPIC",
    "publish_batch",
    "publish_frame",
]

MAX_GOSSIPED_BATCH = MAX_GOSSIP_PAYLOAD
INLINE_LIMIT = MAX_GOSSIPED_BATCH
"""Frames up to this size ride gossip whole; larger ones are announced and fetched."""


async def publish_frame(
    node: Node | NodeContext,
    frame: bytes,
    *,
    transfer: BatchTransfer | None = None,
    max_size: int | None = None,
    inline_limit: int = INLINE_LIMIT,
) -> bytes:
    """Publish one sealed rollout-batch envelope frame; returns its batch id (BLAKE3 of the frame).

    Up to ``inline_limit`` (and the gossip cap) it is gossiped whole; beyond, ``transfer`` holds it and
    its announcement is gossiped. NodeError ``batch_too_large`` when it is over ``max_size`` (the run's
    cap), or too big for gossip and there is no running ``transfer`` to serve it.
    """
    batch_id = blake3(frame)
    if max_size is not None and len(frame) > max_size:
        raise NodeError(
            f"rollout batch frame is {len(frame)} bytes, over the run's max_rollout_batch_bytes "
            f"({max_size}): fewer prompts_per_step or max_new_tokens per batch",
            reason="batch_too_large",
        )
    if len(frame) <= min(inline_limit, MAX_GOSSIPED_BATCH):
        await node.gossip.publish(ROLLOUTS_TOPIC, frame)
        return batch_id
    if transfer is None or not transfer.running:
        raise NodeError(
            f"rollout batch frame is {len(frame)} bytes, over the {MAX_GOSSIPED_BATCH}-byte gossip cap, "
            "and this node runs no batch transfer to serve it over the data plane",
            reason="batch_too_large",
        )
    try:
        envelope = decode(frame, Envelope)
        header = peek_header(envelope.payload)
    except ProtocolError as exc:
        raise NodeError(f"not a sealed rollout batch: {exc}", reason="bad_batch") from exc
    announcement = announcement_for(
        frame,
        run_id=header.run_id,
        worker=header.worker,
        policy_step=header.policy_step,
        batch_counter=header.batch_counter,
        port=transfer.port,
    )
    transfer.hold(batch_id, frame)
    await node.gossip.publish(ROLLOUTS_TOPIC, encode(announcement))
    return batch_id


async def publish_batch(
    node: Node | NodeContext,
    key: WalletKey,
    batch: RolloutBatch,
    *,
    transfer: BatchTransfer | None = None,
    max_size: int | None = None,
    inline_limit: int = INLINE_LIMIT,
) -> bytes:
    """The inferer's side: sign ``batch`` with the worker key and publish it; returns the batch id.

    Validators and the trainer name the batch by this id in verdicts and admission.
    """
    frame = encode(seal_batch(key, batch, now_ms=node.gossip.clock.wall_ms()))
    return await publish_frame(node, frame, transfer=transfer, max_size=max_size, inline_limit=inline_limit)
