"""BatchTransfer on its own: real data-plane channels over TCP on 127.0.0.1, no gossip. Holders that lie,
hold nothing or are busy; the byte bound of what is held; the upload bound per peer."""

from __future__ import annotations

from typing import Any

import trio

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.dataplane.connect import open_channel
from prime_node.verification.batch_transfer import BatchTransfer
from prime_node.verification.transfer_settings import TransferSettings
from protocol.codec import decode, encode
from protocol.rollout_transfer import (
    BUSY,
    MAX_CHANNEL_FRAME,
    ROLLOUT_CONTEXT,
    SENDING,
    BatchReply,
    BatchRequest,
    Holder,
    announcement_for,
)

LOCAL = "127.0.0.1"


def _transfer(key: WalletKey, **settings: Any) -> BatchTransfer:
    caught: list[tuple[Holder, str]] = []
    transfer = BatchTransfer(
        key,
        host_of=lambda _: LOCAL,
        on_bad_bytes=lambda holder, reason: caught.append((holder, reason)),
        host=LOCAL,
        settings=TransferSettings(**settings),
    )
    transfer.caught = caught  # type: ignore[attr-defined]
    return transfer


async def _start(nursery: trio.Nursery, *transfers: BatchTransfer) -> None:
    for transfer in transfers:
        await nursery.start(transfer.run)


def _announce(worker: WalletKey, frame: bytes, transfer: BatchTransfer, fetcher: BatchTransfer) -> bytes:
    """Tell ``fetcher`` that ``transfer``'s node holds ``frame`` (as gossip would); returns the id."""
    announcement = announcement_for(
        frame, run_id="run", worker=worker.address, policy_step=0, batch_counter=1, port=transfer.port
    )
    fetcher.heard(announcement, transfer.key.address, f"peer-{transfer.key.address}")
    return announcement.batch_id


async def test_a_liar_is_caught_and_the_batch_fetched_from_the_worker() -> None:
    worker, liar, fetcher = (_transfer(WalletKey.generate()) for _ in range(3))
    frame = bytes(range(256)) * (40 << 10)  # 10 MiB: three chunks
    async with trio.open_nursery() as nursery:
        await _start(nursery, worker, liar, fetcher)
        batch_id = _announce(worker.key, frame, worker, fetcher)
        worker.hold(batch_id, frame)
        _announce(worker.key, frame, liar, fetcher)  # re-servers are asked before the worker
        liar.store[batch_id] = frame[:-1] + b"\x00"
        with trio.fail_after(30):
            assert await fetcher.fetch(batch_id, len(frame)) == frame
        assert [(h.address, reason) for h, reason in fetcher.caught] == [(liar.key.address, "wrong_bytes")]  # type: ignore[attr-defined]
        assert fetcher.counts["bad_bytes"] == 1 and worker.counts["served"] == 1
        assert [h.address for h in fetcher.book.holders(batch_id)] == [worker.key.address]
        # The fetcher holds and re-serves it now; the liar is never asked again for this batch.
        assert fetcher.store[batch_id] == frame
        nursery.cancel_scope.cancel()


async def test_too_many_bytes_are_refused_and_missing_holders_cost_nothing() -> None:
    worker, long_liar, empty, fetcher = (_transfer(WalletKey.generate()) for _ in range(4))
    frame = b"rollouts" * 1000
    async with trio.open_nursery() as nursery:
        await _start(nursery, worker, long_liar, empty, fetcher)
        batch_id = _announce(worker.key, frame, worker, fetcher)
        worker.hold(batch_id, frame)
        _announce(worker.key, frame, long_liar, fetcher)
        _announce(worker.key, frame, empty, fetcher)
        long_liar.store[batch_id] = frame + b"!"
        with trio.fail_after(30):
            assert await fetcher.fetch(batch_id, len(frame)) == frame
        assert [reason for _, reason in fetcher.caught] == ["wrong_reply"]  # type: ignore[attr-defined]
        assert fetcher.counts["holder_missing"] == 1
        nursery.cancel_scope.cancel()


async def test_a_fetch_with_no_working_holder_gives_up() -> None:
    empty, fetcher = _transfer(WalletKey.generate()), _transfer(WalletKey.generate(), give_up_s=0.5)
    async with trio.open_nursery() as nursery:
        await _start(nursery, empty, fetcher)
        batch_id = _announce(empty.key, b"never served", empty, fetcher)
        with trio.fail_after(10):
            assert await fetcher.fetch(batch_id, 12) is None
        assert fetcher.counts["fetch_failed"] == 1 and fetcher.counts["holder_missing"] == 1
        nursery.cancel_scope.cancel()


def test_what_is_held_is_bounded_in_bytes() -> None:
    transfer = _transfer(WalletKey.generate(), hold_bytes=1000)
    frames = [bytes([i]) * 400 for i in range(5)]
    for frame in frames:
        transfer.hold(blake3(frame), frame)
    assert transfer.held_bytes <= 1000 and list(transfer.store.values()) == frames[-2:]
    big = b"x" * 5000  # the newest is kept even alone over the bound
    transfer.hold(blake3(big), big)
    assert list(transfer.store.values()) == [big]


async def test_uploads_to_one_peer_are_bounded() -> None:
    holder = _transfer(WalletKey.generate(), per_peer_uploads=1)
    reader = WalletKey.generate()
    frame = b"\x07" * (32 << 20)  # more than the socket buffers take: the first upload stays busy
    batch_id = blake3(frame)
    holder.hold(batch_id, frame)
    async with trio.open_nursery() as nursery:
        await _start(nursery, holder)
        first = await _open(holder, reader)
        await first.send_frame(encode(BatchRequest(batch_id)))
        assert decode(await first.receive_frame(), BatchReply).status == SENDING  # then reads nothing
        await trio.sleep(0.5)
        second = await _open(holder, reader)
        await second.send_frame(encode(BatchRequest(batch_id)))
        assert decode(await second.receive_frame(), BatchReply).status == BUSY
        other = await _open(holder, WalletKey.generate())  # another peer is still served
        await other.send_frame(encode(BatchRequest(batch_id)))
        assert decode(await other.receive_frame(), BatchReply).status == SENDING
        for channel in (first, second, other):
            await channel.aclose()
        nursery.cancel_scope.cancel()


async def _open(holder: BatchTransfer, key: WalletKey) -> Any:
    return await open_channel(
        LOCAL,
        holder.port,
        key,
        expected_peer=holder.key.address,
        context=ROLLOUT_CONTEXT,
        max_frame=MAX_CHANNEL_FRAME,
    )
