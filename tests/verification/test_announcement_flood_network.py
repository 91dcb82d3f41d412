"""The issue 35 attack on a live validator, on real libp2p hosts and real data-plane channels on 127.0.0.1:
a key announces 16 batches and accepts the data-plane channel without ever answering, another claims to
hold the honest batch and serves zeros; the honest batch is still fetched and judged, the announcer gets
only its share of fetches and is charged, and the liar is banned."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.dataplane.channel import AuthenticatedChannel
from prime_node.dataplane.connect import serve_channels
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.verification.batch_publish import ROLLOUTS_TOPIC, publish_frame
from prime_node.verification.batch_transfer import BatchTransfer
from protocol.codec import decode, encode
from protocol.envelope import Envelope
from protocol.rollout_transfer import (
    MAX_CHANNEL_FRAME,
    ROLLOUT_CONTEXT,
    RolloutAnnouncement,
    announcement_for,
)
from protocol.rollouts import peek_header
from tests.p2p.helpers import wait_until
from tests.verification.network_helpers import fresh, judged, make_scenario, start_swarm

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
OFFERS = 16


async def _silent(channel: AuthenticatedChannel) -> None:
    await trio.sleep_forever()  # accepts the channel, reads nothing, answers nothing


def _offer_of(frame: bytes, *, port: int) -> RolloutAnnouncement:
    header = peek_header(decode(frame, Envelope).payload)
    return announcement_for(
        frame,
        run_id=header.run_id,
        worker=header.worker,
        policy_step=header.policy_step,
        batch_counter=header.batch_counter,
        port=port,
    )


async def test_announcements_that_never_resolve_do_not_stop_validation_and_a_liar_is_banned(
    tmp_path: Path,
) -> None:
    validator = WalletKey.generate()
    scenario = make_scenario([validator])
    async with trio.open_nursery() as nursery:
        swarm = await start_swarm(nursery, OPEN, tmp_path, scenario, [validator], observers=2)
        validator_node, service = swarm.validators[0]
        announcer, liar = swarm.others
        silent_port = await nursery.start(
            functools.partial(
                serve_channels,
                announcer.key,
                _silent,
                host="127.0.0.1",
                context=ROLLOUT_CONTEXT,
                max_frame=MAX_CHANNEL_FRAME,
            )
        )
        worker_transfer = BatchTransfer(scenario.key, host_of=lambda _: None, host="127.0.0.1")
        liar_transfer = BatchTransfer(liar.key, host_of=lambda _: None, host="127.0.0.1")
        await nursery.start(worker_transfer.run)
        await nursery.start(liar_transfer.run)
        await trio.sleep(2)  # let the gossipsub mesh settle after the connections

        cap = scenario.config.max_rollout_batch_bytes
        template: dict[str, Any] = {"run_id": scenario.config.run_id, "policy_step": scenario.current_step}
        for counter in range(OFFERS):
            offer = RolloutAnnouncement(
                bytes([counter]) * 32, cap, worker=announcer.key.address, batch_counter=1000 + counter,
                port=silent_port, **template,
            )  # fmt: skip
            await announcer.gossip.publish(ROLLOUTS_TOPIC, encode(offer))
        await wait_until(lambda: service.counts["refused_worker_fetches"] == OFFERS - 4, 30)
        assert service.status()["fetches_pending"] == 4  # its share (per_worker_fetches), no more

        honest = fresh(scenario)
        frame = honest.seal(honest.batch(7))
        batch_id = _offer_of(frame, port=1).batch_id
        liar_transfer.store[batch_id] = bytes(len(frame))  # right length, wrong bytes
        await liar.gossip.publish(ROLLOUTS_TOPIC, encode(_offer_of(frame, port=liar_transfer.port)))
        assert service.transfer is not None
        await wait_until(lambda: bool(service.transfer and service.transfer.book.holders(batch_id)), 30)

        published = await publish_frame(swarm.inferer, frame, transfer=worker_transfer, inline_limit=0)
        assert published == batch_id
        # Before: the 16 offers held every download slot for 30-74 s each: nothing else was fetched.
        assert await judged(service, batch_id, timeout=60) == ()
        assert validator_node.policy.is_banned(liar.record().peer_id)  # not only charged
        assert liar.key.address in service.transfer.banned
        await wait_until(lambda: service.counts["undelivered"] >= 1, 60)
        assert validator_node.policy.score(announcer.record().peer_id) < 0  # charged for its own offers
        nursery.cancel_scope.cancel()
