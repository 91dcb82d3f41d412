"""Services get a read-only NodeContext and report what they hold; the node puts it in its peer record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from prime_node.node.context import NodeContext, RecordPart
from prime_node.node.service import UNPROBED
from prime_node.testing.memory_network import MemoryNetwork
from protocol.peer_record import HardwareSummary
from tests.p2p.helpers import make_config, start_node, wait_until

HARDWARE = HardwareSummary(cpu_cores=8, ram_mib=16384, gpu_count=1, gpu_vram_mib=24576)


class Reporter:
    """A service that reports a role and the versions it holds, and shows a status section."""

    def __init__(self) -> None:
        self.versions: tuple[int, ...] = ()
        self.context: NodeContext | None = None

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.context = context
        context.add_record_source(lambda: RecordPart(role="validator", versions_held=self.versions))
        context.add_status_section("reporter", lambda: {"versions": list(self.versions)})
        task_status.started()


class PortReporter:
    """A service that reports the port it serves on and an older set of versions."""

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        context.add_record_source(lambda: RecordPart(dataplane_port=4242, versions_held=(7,)))
        task_status.started()


async def test_reports_reach_the_peer_record_that_others_see(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    network = MemoryNetwork()
    reporter = Reporter()
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 0),
            serve_api=False,
            services=[PortReporter(), reporter],
            hardware=HARDWARE,
        )
        observer, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 1, bootstrap=(node.host.listen_multiaddrs()[0],)),
            serve_api=False,
        )
        assert observer.record().hardware == UNPROBED  # a node built without a probe does none
        reporter.versions = (3, 4)
        record = node.record()
        assert (record.role, record.hardware, record.versions_held, record.dataplane_port) == (
            "validator",
            HARDWARE,
            (3, 4),  # the later source wins the field both set
            4242,
        )
        assert node.role == "validator" and node.versions_held == (3, 4) and node.dataplane_port == 4242
        assert node.status_sections["reporter"]() == {"versions": [3, 4]}

        def seen() -> bool:
            member = observer.membership.get(node.identity.peer_id)
            return member is not None and member.record.versions_held == (3, 4)

        await wait_until(seen, timeout=30)
        member = observer.membership.get(node.identity.peer_id)
        assert member is not None
        assert (member.record.role, member.record.hardware) == ("validator", HARDWARE)
        nursery.cancel_scope.cancel()


async def test_the_context_is_read_only(tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
    reporter = Reporter()
    async with trio.open_nursery() as nursery:
        node, scope = await start_node(
            nursery, MemoryNetwork().host, make_config(tmp_path, 0), serve_api=False, services=[reporter]
        )
        context = reporter.context
        assert context is node.context and context is not None
        assert context.identity == node.identity and context.run_id == "test" and context.is_running
        with pytest.raises(AttributeError):
            context.key = node.key  # type: ignore[misc]
        with pytest.raises(AttributeError):
            context.policy = None  # type: ignore[assignment, misc]
        with pytest.raises(AttributeError):
            context.extra = 1  # type: ignore[attr-defined]
        scope.cancel()
        await wait_until(lambda: not context.is_running, timeout=5)
        nursery.cancel_scope.cancel()


def test_a_failing_record_source_is_left_out() -> None:
    from prime_node.node.context import NodeReports

    def broken() -> RecordPart:
        raise RuntimeError("a service bug")

    reports = NodeReports()
    reports.record_sources += [lambda: RecordPart(role="inferer"), broken, lambda: RecordPart(load_percent=5)]
    base = RecordPart("auto", UNPROBED, (), 0, 0)
    assert reports.record(base) == RecordPart("inferer", UNPROBED, (), 0, 5)


def test_a_record_part_overrides_only_the_fields_it_sets() -> None:
    base = RecordPart("auto", UNPROBED, (), 0, 0)
    assert RecordPart(role="inferer").over(base) == RecordPart("inferer", UNPROBED, (), 0, 0)
    assert RecordPart(versions_held=(), dataplane_port=9).over(RecordPart(versions_held=(1,))) == RecordPart(
        versions_held=(), dataplane_port=9
    )
