"""The live status view on a terminal (issue 36): a real node's every section renders as values, and the
pages each fit an 80×24 terminal."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import trio
from rich.console import Console, RenderableType

from crypto.keys import WalletKey
from prime_node.node.probe_service import ProbeService
from prime_node.node.reachability_service import ReachabilityService
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.status.client import fetch_snapshot
from prime_node.status.sections import step_text
from prime_node.status.tui import pages, render
from prime_node.swarm.service import SwarmService, SwarmSettings
from tests.p2p.helpers import make_config, start_node, wait_until
from tests.roles.test_status_view import document

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
PYTHON_TYPE = re.compile(r"\((dict|list|tuple|NoneType|bool|int|float|str|bytes)\)")


def lines_of(renderable: RenderableType, width: int = 80) -> list[str]:
    console = Console(record=True, width=width, color_system=None, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text().splitlines()


async def test_a_live_nodes_every_section_renders_as_values_on_pages_that_fit_80_by_24(
    tmp_path: Path,
) -> None:
    key = WalletKey.generate()
    async with trio.open_nursery() as nursery:
        seed, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        swarm = SwarmService(
            key=key,
            run_id="demo",
            trainer=None,
            store_dir=tmp_path / "swarm",
            settings=SwarmSettings(dataplane_host="127.0.0.1"),
        )
        node, _ = await start_node(
            nursery,
            OPEN,
            make_config(tmp_path, 1, bootstrap=(seed.advertised_multiaddrs()[0],)),
            key=key,
            services=[swarm, ProbeService(), ReachabilityService((seed.advertised_multiaddrs()[0],))],
        )
        await wait_until(lambda: bool(node.status_sections["reachability"]()), timeout=60)
        assert node.api_url is not None
        data: dict[str, Any] = await trio.to_thread.run_sync(fetch_snapshot, node.api_url)
        nursery.cancel_scope.cancel()
    assert {"probe", "reachability", "checkpoints"} <= set(data["sections"])
    whole = "\n".join(lines_of(render(data), width=120))
    assert not PYTHON_TYPE.search(whole), PYTHON_TYPE.search(whole)
    for name in ("probe", "reachability"):
        assert name in whole
    shown = pages(data, width=80, height=24)
    for number, page in enumerate(shown, start=1):
        text = lines_of(page)
        assert len(text) <= 24, (number, len(text))
        assert text[-1].startswith(f"page {number}/{len(shown)}") and "q quit" in text[-1]
        assert not PYTHON_TYPE.search("\n".join(text))


def test_a_busy_nodes_pages_fit_the_terminal_and_show_every_panel() -> None:
    doc = document()
    doc["peers"] = doc["peers"] * 60
    doc["events"] = [{"at_s": float(i), "kind": "info", "text": f"event {i}"} for i in range(40)]
    doc["sections"]["training"] |= {"max_steps": 400, "steps_per_s": 0.1}
    for height in (24, 40):
        shown = pages(doc, width=80, height=height)
        text = ["\n".join(lines_of(page)) for page in shown]
        assert all(len(page.splitlines()) <= height for page in text)
        everything = "\n".join(text)
        for title in ("prime-node", "role", "checkpoints", "rollouts", "validation", "training", "peers"):
            assert title in everything
        assert "recent events" in everything and "event 39" in everything
        assert "5/400 · ETA 1 h 05 min (0.10 steps/s)" in everything
        assert "weird" in everything and "nested={x=1}" in everything


def test_the_step_says_how_far_how_long_and_when_the_run_has_ended() -> None:
    assert str(step_text(306, 400, 0.5)) == "306/400 · ETA 3 min 08 s (0.50 steps/s)"
    assert str(step_text(400, 400, 0.0)) == "400/400 · the run has ended"
    assert str(step_text(3, None, None)) == "3"
    assert str(step_text(None, 400, 1.0)) == "-"
    assert json.dumps(str(step_text(1, 400, None))) == '"1/400"'
