"""yamux with window credit returned per half window (prime_node/p2p/yamux_tuning.py): a user's own
setting wins, and two real hosts on loopback still move many small frames and frames far larger than the
256 KiB window both ways without stalling, with about half as many WINDOW_UPDATEs as reads."""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.p2p.interface import FramedStream
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.p2p.yamux_tuning import RELEASE_ON_READ, tune_yamux

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


def test_the_switch_is_set_unless_the_user_set_it() -> None:
    environ: dict[str, str] = {}
    tune_yamux(environ)
    assert environ == {RELEASE_ON_READ: "0"}
    mine = {RELEASE_ON_READ: "1"}
    tune_yamux(mine)
    assert mine == {RELEASE_ON_READ: "1"}


async def test_small_and_window_sized_frames_flow_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RELEASE_ON_READ, raising=False)
    environ = dict(os.environ)
    tune_yamux(environ)
    monkeypatch.setenv(RELEASE_ON_READ, environ[RELEASE_ON_READ])
    async with OPEN(WalletKey.generate()) as a, OPEN(WalletKey.generate()) as b:

        async def echo(stream: FramedStream) -> None:
            while (frame := await stream.receive_frame(4 << 20)) is not None:
                await stream.send_frame(frame)

        b.set_stream_handler("/test/echo/1", echo)
        await a.connect(b.listen_multiaddrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/echo/1")
        big = os.urandom(3 << 20)  # 12 windows of 256 KiB each way
        with trio.fail_after(60):
            for index in range(600):  # ~600 KiB of small frames: credit has to come back several times
                payload = index.to_bytes(4, "big") * 256
                await stream.send_frame(payload)
                assert await stream.receive_frame() == payload
            for _ in range(2):
                await stream.send_frame(big)
                assert await stream.receive_frame(4 << 20) == big
        raw: Any = stream.raw
        muxed = raw._stream.muxed_stream  # the yamux stream the switch governs
        assert muxed._window_update_bytes_read_only == 0  # no credit returned just for a read
        updates = (
            muxed._window_update_bytes_read_only
            + muxed._window_update_partial_slack
            + muxed._window_update_full_grow
            + muxed._window_update_pending_flush
        )
        assert updates < 0.75 * 600  # one per read with the switch on; ~every other read with it off
        await stream.close()
