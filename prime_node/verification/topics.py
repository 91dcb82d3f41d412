"""The inferer's side of verification's two gossip topics (named in protocol/topics.py): seal and gossip.

Rollout batches ride gossip whole while they fit its 256 KiB payload cap (a tiny-model batch is a few
tens of KiB). Bigger batches need the announce-then-fetch path of DESIGN §4 (gossip carries id, size,
step and signer; the frame moves over the data plane); until that exists ``publish_batch`` refuses them
with a clear error rather than letting the gossip layer fail somewhere deeper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.verification.proving import seal_batch
from protocol.codec import encode
from protocol.gossip_sequence import MAX_GOSSIP_PAYLOAD
from protocol.rollouts import RolloutBatch
from protocol.topics import ROLLOUTS_TOPIC, VERDICTS_TOPIC

if TYPE_CHECKING:
    from prime_node.node.context import NodeContext
    from prime_node.node.service import Node

__all__ = [  # the topics are re-exported: services import them from here
    "MAX_GOSSIPED_BATCH",
    "ROLLOUTS_TOPIC",
    "VERDICTS_TOPIC",
    "publish_batch",
    "publish_frame",
]

MAX_GOSSIPED_BATCH = MAX_GOSSIP_PAYLOAD


async def publish_frame(node: Node | NodeContext, frame: bytes) -> bytes:
    """Gossip one sealed rollout-batch envelope frame as is; returns its batch id (BLAKE3 of the frame)."""
    if len(frame) > MAX_GOSSIPED_BATCH:
        raise NodeError(
            f"rollout batch frame is {len(frame)} bytes, over the {MAX_GOSSIPED_BATCH}-byte gossip cap "
            "(fewer prompts_per_step or max_new_tokens per batch; large batches need announce + fetch, "
            "not built yet)",
            reason="batch_too_large",
        )
    await node.gossip.publish(ROLLOUTS_TOPIC, frame)
    return blake3(frame)


async def publish_batch(node: Node | NodeContext, key: WalletKey, batch: RolloutBatch) -> bytes:
    """The inferer's side: sign ``batch`` with the worker key and gossip it; returns the batch id.

    Validators and the trainer name the batch by this id in verdicts and admission.
    """
    frame = encode(seal_batch(key, batch, now_ms=node.gossip.clock.wall_ms()))
    return await publish_frame(node, frame)
