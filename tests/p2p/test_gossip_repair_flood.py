"""Gossip repair is no flood channel: a hostile origin that answers a repair request with thousands of
signed frames gets only the numbers it was asked for, within its budget, is charged for the rest and
banned; one that answers every gap with the whole span is charged like any other flood."""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import trio

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.node.gossip import REPAIR_PROTOCOL, Delivered
from prime_node.node.service import Node
from prime_node.p2p.interface import FramedStream, GossipMessage, P2PHost
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.testing.memory_network import MemoryNetwork
from protocol.codec import decode, encode
from protocol.envelope import Domain, seal
from protocol.gossip_sequence import MAX_REPAIR_SPAN, GossipFrame, RepairRequest
from protocol.scoring import Offence
from tests.p2p.helpers import make_config, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
TOPIC = "prime-node/test/spam"
FLOOD_FRAMES = 5_000


class Origins:
    """Counts what the victim delivered, by origin."""

    def __init__(self) -> None:
        self.delivered: Counter[str] = Counter()

    async def __call__(self, message: Delivered) -> None:
        self.delivered[message.origin_peer_id] += 1


class Hostile:
    """A peer with a valid key that publishes its own signed frames and answers repairs its own way."""

    def __init__(self, host: P2PHost, key: WalletKey) -> None:
        self.host, self.key, self.clock = host, key, NodeClock()
        self.epoch_ms = self.clock.wall_ms()
        self.domain = Domain("gossip", "test")
        self.published = 0
        self.requests: list[RepairRequest] = []
        self.repair_frames_sent = 0

    def frame(self, sequence: int) -> bytes:
        frame = GossipFrame(TOPIC, self.epoch_ms, sequence, b"spam %d" % sequence)
        return encode(seal(self.key, self.domain, encode(frame), now_ms=self.clock.wall_ms()))

    async def publish(self, sequence: int) -> None:
        await self.host.publish(TOPIC, self.frame(sequence))
        self.published += 1

    async def serve(self, answer: Callable[[RepairRequest], list[bytes]], stream: FramedStream) -> None:
        raw = await stream.receive_frame(RepairRequest.MAX_BYTES)
        if raw is None:
            return
        request = decode(raw, RepairRequest)
        self.requests.append(request)
        try:
            with trio.move_on_after(15):
                for frame in answer(request):
                    await stream.send_frame(frame)
                    self.repair_frames_sent += 1
        except NodeError:  # the victim hung up: what we hoped for
            pass


async def _ignore(_: GossipMessage) -> None:
    return None


async def _first_contact(hostile: Hostile, victim: Node, seen: Origins) -> int:
    """Publish until the victim has delivered one frame (the mesh may need a moment); returns the next
    sequence number the victim expects."""
    sequence = 0
    with trio.fail_after(20):
        while not seen.delivered[hostile.host.peer_id]:
            await hostile.publish(sequence)
            sequence += 1
            await trio.sleep(0.5)
    await trio.sleep(0.5)  # let any frame still in flight land before the gap is made
    return hostile.published


async def test_a_repair_answered_with_thousands_of_frames_is_cut_off_and_banned(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        victim, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        seen = Origins()
        await victim.gossip.subscribe("spam", seen)
        key = WalletKey.generate()
        async with OPEN(key) as host:
            hostile = Hostile(host, key)
            await host.subscribe(TOPIC, _ignore)
            # The answer to any repair: every number from 1 up, far beyond what can have been asked.
            answer = [hostile.frame(sequence) for sequence in range(1, FLOOD_FRAMES + 1)]
            host.set_stream_handler(REPAIR_PROTOCOL, functools.partial(hostile.serve, lambda _: answer))
            await host.connect(victim.advertised_multiaddrs()[0])
            next_expected = await _first_contact(hostile, victim, seen)
            gap = 7
            started = trio.current_time()
            await hostile.publish(next_expected + gap)  # the victim now asks for the 7 it skipped
            await wait_until(lambda: victim.policy.is_banned(host.peer_id), timeout=20)
            banned_after = trio.current_time() - started
            await trio.sleep(1.0)
            delivered = seen.delivered[host.peer_id]
            print(
                f"repair flood: offered {FLOOD_FRAMES}, written {hostile.repair_frames_sent}, delivered "
                f"{delivered} ({hostile.published} on gossip), banned after {banned_after:.2f} s, "
                f"offences {victim.policy.scores.offences(host.peer_id)}"
            )
            assert hostile.requests and all(r.last - r.first + 1 <= gap for r in hostile.requests)
            # Nothing beyond what was published and what was asked for reached the application.
            assert delivered <= hostile.published + gap
            # Charged for what it pushed beyond the gap, and no more read once it was banned.
            scoring = victim.scoring
            to_ban = math.ceil(-scoring.ban_threshold / scoring.penalties[Offence.UNSOLICITED]) + 1
            unsolicited = victim.policy.scores.offences(host.peer_id).get("unsolicited", 0)
            assert 1 <= unsolicited <= to_ban
            assert victim.metrics.rejections["unsolicited_repair_frame"] == unsolicited
            await wait_until(lambda: host.peer_id not in victim.host.connected_peers(), timeout=10)
        nursery.cancel_scope.cancel()


async def test_answering_every_gap_with_the_whole_span_is_charged_as_a_flood(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """In-range answers only (nothing unsolicited): the frames still count against the sender's flood
    limit and probation budget, so the repair stream is charged and the sender banned like any flood."""
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        victim, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        seen = Origins()
        await victim.gossip.subscribe("spam", seen)
        key = WalletKey.generate()
        async with network.host(key) as host:
            hostile = Hostile(host, key)
            await host.subscribe(TOPIC, _ignore)

            def whole_span(request: RepairRequest) -> list[bytes]:
                return [hostile.frame(s) for s in range(request.first, request.last + 1)]

            host.set_stream_handler(REPAIR_PROTOCOL, functools.partial(hostile.serve, whole_span))
            await host.connect(victim.host.listen_multiaddrs()[0])
            sequence = await _first_contact(hostile, victim, seen)
            rounds = 0
            with trio.move_on_after(60):
                while not victim.policy.is_banned(host.peer_id):
                    sequence += MAX_REPAIR_SPAN  # skip a full span: the victim asks for all of it
                    await hostile.publish(sequence)
                    rounds += 1
                    await trio.sleep(1.1)  # one gap per flood window
            assert victim.policy.is_banned(host.peer_id)
            offences = victim.policy.scores.offences(host.peer_id)
            assert offences.get("flood", 0) >= 1 and "unsolicited" not in offences
            # What was delivered stayed within a new key's probation budget over the time it took.
            config = victim.scoring
            budget = config.probation_burst + config.probation_rate * rounds * 1.1 + hostile.published
            assert seen.delivered[host.peer_id] <= budget
            print(
                f"in-span repair flood: {rounds} gaps of {MAX_REPAIR_SPAN - 1}, "
                f"{hostile.repair_frames_sent} repair frames written, "
                f"{seen.delivered[host.peer_id]} delivered, offences {offences}"
            )
        nursery.cancel_scope.cancel()
