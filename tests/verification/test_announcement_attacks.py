"""Announcements that never resolve, and holders that trickle or lie (issue 35 items 1 and 2), against
``BatchTransfer`` alone: real data-plane channels over the in-memory stream network, in virtual time
(``autojump_clock``), so the deadlines of minutes-long attacks are checked exactly and instantly."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import trio
import trio.testing

from crypto.keys import WalletKey
from prime_node.dataplane.channel import AuthenticatedChannel
from prime_node.dataplane.connect import serve_channels
from prime_node.testing.memory_streams import MemoryStreamNetwork
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.transfer_settings import TransferSettings
from protocol.codec import decode, encode
from protocol.rollout_transfer import (
    MAX_CHANNEL_FRAME,
    ROLLOUT_CONTEXT,
    SENDING,
    WRONG_START,
    BatchReply,
    BatchRequest,
    Holder,
    RolloutAnnouncement,
    announcement_for,
    check_frame_start,
)
from tests.protocol.test_rollout_transfer_start import KIND, _frame

HOST = "10.0.0.1"
BIG = 64 << 20  # what the old default cap let a key announce


def _transfer(network: MemoryStreamNetwork, key: WalletKey | None = None, **settings: Any) -> BatchTransfer:
    events: dict[str, list[tuple[Holder, str]]] = {"bad": [], "undelivered": []}
    transfer = BatchTransfer(
        key or WalletKey.generate(),
        host_of=lambda _: HOST,
        host=HOST,
        transport=network,
        on_bad_bytes=lambda holder, reason: events["bad"].append((holder, reason)),
        on_undelivered=lambda holder, reason: events["undelivered"].append((holder, reason)),
        settings=TransferSettings(**settings),
    )
    transfer.events = events  # type: ignore[attr-defined]
    return transfer


class _Hostile:
    """A peer's rollout port that accepts channels and then does what ``behave`` does with them."""

    def __init__(self, network: MemoryStreamNetwork, behave: str) -> None:
        self.network = network
        self.key = WalletKey.generate()
        self.behave = behave
        self.channels = 0
        self.port = 0

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await serve_channels(
            self.key,
            self._serve,
            host=HOST,
            context=ROLLOUT_CONTEXT,
            max_frame=MAX_CHANNEL_FRAME,
            transport=self.network,
            task_status=task_status,
        )

    async def _serve(self, channel: AuthenticatedChannel) -> None:
        self.channels += 1
        request = decode(await channel.receive_frame(), BatchRequest)
        if self.behave == "trickle":
            await channel.send_frame(encode(BatchReply(request.batch_id, SENDING, BIG)))
            while True:
                await trio.sleep(1)
                await channel.send_frame(b"\x00" * 1024)  # 1 KiB/s: each frame in time, the batch never
        await trio.sleep_forever()  # "silent": the channel is open, no reply ever comes

    def offer(self, fetcher: BatchTransfer, counter: int, size: int = BIG) -> RolloutAnnouncement:
        """Gossip (as far as ``fetcher`` knows) an offer of a batch this peer will never deliver."""
        announcement = dataclasses.replace(
            announcement_for(
                counter.to_bytes(8, "big"),
                run_id="run",
                worker=self.key.address,
                policy_step=0,
                batch_counter=counter,
                port=self.port,
            ),
            size=size,
        )
        fetcher.heard(announcement, self.key.address, f"peer-{self.key.address}")
        return announcement


async def _start(nursery: trio.Nursery, *peers: BatchTransfer | _Hostile) -> None:
    for peer in peers:
        port = await nursery.start(peer.run)
        if isinstance(peer, _Hostile):
            peer.port = port


def _honest(worker: BatchTransfer, fetcher: BatchTransfer, frame: bytes) -> bytes:
    announcement = announcement_for(
        frame, run_id="run", worker=worker.key.address, policy_step=0, batch_counter=1, port=worker.port
    )
    worker.hold(announcement.batch_id, frame)
    fetcher.heard(announcement, worker.key.address, f"peer-{worker.key.address}")
    return announcement.batch_id


async def test_a_silent_holder_costs_the_reply_deadline_whatever_the_size_and_is_charged(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    silent, fetcher = _Hostile(network, "silent"), _transfer(network)
    async with trio.open_nursery() as nursery:
        await _start(nursery, silent, fetcher)
        offer = silent.offer(fetcher, 1)
        began = trio.current_time()
        assert await fetcher.fetch(offer.batch_id, offer.size) is None
        took = trio.current_time() - began
        # Before: 10 s + 64 MiB / 1 MiB/s = 74 s for the attempt, and the fetch waited on.
        assert took < 2 * fetcher.settings.reply_timeout_s, took
        assert [(h.address, why) for h, why in fetcher.events["undelivered"]] == [  # type: ignore[attr-defined]
            (silent.key.address, "timed_out")
        ]
        nursery.cancel_scope.cancel()


async def test_a_holder_that_trickles_is_cut_off_by_the_byte_rate_floor(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    trickler, fetcher = _Hostile(network, "trickle"), _transfer(network)
    async with trio.open_nursery() as nursery:
        await _start(nursery, trickler, fetcher)
        offer = trickler.offer(fetcher, 1)
        began = trio.current_time()
        assert await fetcher.fetch(offer.batch_id, offer.size) is None
        settings = fetcher.settings
        assert trio.current_time() - began < 2 * (settings.chunk_grace_s + (4 << 20) / settings.min_rate)
        assert fetcher.counts["attempt_too_slow"] == 1
        assert [why for _, why in fetcher.events["undelivered"]] == ["too_slow"]  # type: ignore[attr-defined]
        nursery.cancel_scope.cancel()


async def test_never_resolving_offers_do_not_hold_the_slots_an_honest_batch_needs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    silent, worker, fetcher = _Hostile(network, "silent"), _transfer(network), _transfer(network)
    frame = b"an honest batch" * 1000
    async with trio.open_nursery() as nursery:
        await _start(nursery, silent, worker, fetcher)
        for counter in range(16):  # the attack: 16 offers of 64 MiB, accepted and never answered
            offer = silent.offer(fetcher, counter)
            nursery.start_soon(fetcher.fetch, offer.batch_id, offer.size)
        await trio.sleep(1)
        batch_id = _honest(worker, fetcher, frame)
        began = trio.current_time()
        assert await fetcher.fetch(batch_id, len(frame)) == frame
        # Before: every slot was held by a fetch waiting on the silent peer (74 s each, then 30 s more).
        assert trio.current_time() - began < fetcher.settings.reply_timeout_s
        # One announcer's port got at most per_peer_fetches connections, not one per offer: after the
        # first ones timed out it is backed off, and the offers it made fail without a dial.
        await trio.sleep(fetcher.settings.reply_timeout_s * 2)
        assert silent.channels <= fetcher.settings.per_peer_fetches < 16
        assert fetcher.status()["fetching"] == 0
        nursery.cancel_scope.cancel()


async def test_a_holder_sending_other_bytes_is_refused_at_the_first_chunk_and_banned(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    key = WalletKey(b"\x05" * 32)  # the key the frame helper seals with: the worker
    worker, liar, fetcher = _transfer(network, key), _transfer(network), _transfer(network)
    frame = _frame(samples=4000, tokens=400)  # ~13 MiB
    async with trio.open_nursery() as nursery:
        await _start(nursery, worker, liar, fetcher)
        offer = announcement_for(
            frame, run_id="run", worker=key.address, policy_step=3, batch_counter=9, port=worker.port
        )
        worker.hold(offer.batch_id, frame)
        fetcher.heard(offer, key.address, "worker")
        liar.store[offer.batch_id] = bytes(len(frame))
        fetcher.heard(dataclasses.replace(offer, port=liar.port), liar.key.address, "liar")  # asked first
        check = functools.partial(check_frame_start, offer, kind=KIND)
        assert await fetcher.fetch(offer.batch_id, len(frame), check_start=check) == frame
        assert [(h.address, why) for h, why in fetcher.events["bad"]] == [(liar.key.address, WRONG_START)]  # type: ignore[attr-defined]
        assert liar.key.address in fetcher.banned
        # Banned: its next offer is not even heard, so nothing is dialled.
        dials = network.dials
        assert not fetcher.heard(
            dataclasses.replace(offer, batch_id=bytes(32), worker=liar.key.address, port=liar.port),
            liar.key.address,
            "liar",
        )
        assert network.dials == dials
        nursery.cancel_scope.cancel()


# The round-robin of fetch slots and the eviction past all workers' bounds moved to test_inbox.py (the
# shared rollout inbox), where they run against the validator's and the trainer's intake.
