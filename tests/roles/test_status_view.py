"""The status TUI's sections, the whole-swarm view and the sections' Prometheus lines: sample documents
(full, empty, garbage) and properties over arbitrary JSON-like contents."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console, RenderableType

from prime_node.node.snapshot import prometheus_text
from prime_node.status.sections import availability_bar, sparkline
from prime_node.status.swarm_view import render_swarm
from prime_node.status.tui import render
from protocol.resources import GpuInfo, HardwareProfile

TRAINER = "0x" + "ab" * 20
WORKER = "0x" + "cd" * 20
PROFILE = HardwareProfile((GpuInfo(0, "NVIDIA GeForce RTX 4090", 24564, (8, 9)),), 16, 65536, 512000, "nvml")

SECTIONS: dict[str, Any] = {
    "role": {
        "role": "inferer",
        "reason": "inferer: 24.0 GiB VRAM >= 2.9 GiB needed; backlog 3 < 8",
        "since_s": 42.0,
        "switches": 2,
        "profile": PROFILE.describe(),
    },
    "checkpoints": {
        "versions": [
            {
                "step": 3,
                "manifest_id": "ab" * 32,
                "pieces": 40,
                "have": 40,
                "state": "seeding",
                "availability": [3] * 40,
            },
            {
                "step": 4,
                "manifest_id": "cd" * 32,
                "pieces": 200,
                "have": 120,
                "state": "fetching",
                "availability": [0, 1, 2, 3, 4, 9] * 20,
            },
        ],
        "bytes_in": 5 << 20,
        "bytes_out": 1 << 20,
        "peers": 4,
    },
    "rollouts": {"produced": 12, "published": 11, "accepted": 9, "rejected": {"stale": 2}},
    "validation": {
        "validated": 30,
        "accepted": 27,
        "rejected": {"proof_mismatch": 2, "bad_signature": 1},
        "backlog": 3,
        "mean_validate_s": 0.42,
    },
    "training": {
        "step": 5,
        "reward_curve": [[i, 0.1 * i] for i in range(6)],
        "held_out": [[0, 0.05], [5, 0.4]],
        "batches_accepted": 20,
        "batches_rejected": {"unverified": 3},
        "accepted_by_worker": {WORKER: 20},
        "checkpoints_shared": 5,
    },
    "weird": {"note": "[bold]not markup[/]", "count": 7, "nested": {"x": 1}},
}


def document(sections: Any = None, **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "version": 1,
        "address": TRAINER,
        "peer_id": "16Uiu2HAmExamplePeerIdentifier",
        "role": "auto",
        "run": "demo",
        "uptime_s": 12.5,
        "multiaddrs": ["/ip4/127.0.0.1/tcp/4001/p2p/16Uiu2HAmExamplePeerIdentifier"],
        "api": "http://127.0.0.1:1",
        "connected_peers": 1,
        "routing_table_size": 1,
        "peers": [
            {
                "address": WORKER,
                "peer_id": "16Uiu2HAmOther",
                "state": "healthy",
                "role": "inferer",
                "connected": True,
                "score": 0.0,
                "banned": False,
                "latency_ms": 3,
                "last_heard_s": 0.5,
                "load_percent": 10,
            }
        ],
        "banned": [],
        "counters": {"heartbeats_sent": 10, "gossip_in": 4},
        "rejections": {"expired": 1},
        "sections": copy.deepcopy(SECTIONS) if sections is None else sections,
        "events": [{"at_s": 1.0, "kind": "start", "text": "node started"}],
    }
    doc.update(overrides)
    return doc


def text_of(renderable: RenderableType, width: int = 160) -> str:
    console = Console(record=True, width=width, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_full_document_shows_every_section() -> None:
    text = text_of(render(document()))
    for expected in (
        "inferer: 24.0 GiB VRAM >= 2.9 GiB needed; backlog 3 < 8",
        "1x NVIDIA GeForce RTX 4090 (24.0 GiB), 16 cores, 64.0 GiB RAM",
        "120/200",
        "fetching",
        "bytes in 5.0 MiB",
        "stale=2",
        "proof_mismatch=2",
        "mean validate s",
        "0.42",
        "last 0.500 @ step 5",
        "last 0.400 @ step 5",
        "unverified=3",
        "[bold]not markup[/]",
        "healthy",
    ):
        assert expected in text, expected
    assert sparkline([0.1 * i for i in range(6)]) in text


def test_rates_between_two_refreshes() -> None:
    before = document()
    after = document()
    after["sections"]["rollouts"]["produced"] = 22
    after["sections"]["checkpoints"]["bytes_in"] = (5 << 20) + 2048
    after["counters"]["heartbeats_sent"] = 30
    text = text_of(render(after, before, 2.0))
    assert "rollouts produced" in text and "5.00/s" in text
    assert "1.0 KiB/s" in text
    assert "10.0 msg/s" in text


def test_empty_and_missing_sections() -> None:
    assert "prime-node" in text_of(render(document(sections={})))
    missing = document()
    del missing["sections"]
    assert "healthy" in text_of(render(missing))
    text = text_of(render(document(sections={"role": {}, "checkpoints": {}, "rollouts": {}, "training": {}})))
    assert "role" in text and "checkpoints" in text and "step" in text


def test_garbage_values_render_as_missing() -> None:
    garbage = {
        "role": {"role": 5, "reason": ["x"], "since_s": "soon", "profile": {"gpus": "many", "ram_mib": None}},
        "checkpoints": {
            "versions": [None, 3, {"step": "x", "availability": ["a", -1, 1e308, 2]}],
            "peers": {},
        },
        "rollouts": {"produced": float("nan"), "rejected": {"a": "b", "c": True, "d": 1}},
        "validation": {"error": "RuntimeError: boom"},
        "training": {"reward_curve": [[1], [2, "x"], "y", [3, float("inf")], [4, 0.5]], "held_out": 7},
        "5": [1, 2, 3],
    }
    text = text_of(render(document(sections=garbage)))
    assert "error: RuntimeError: boom" in text
    assert "d=1" in text and "a=" not in text
    assert "last 0.500 @ step 4" in text
    assert "?" in text  # unreadable availability cells
    assert "prime-node" in text_of(render({"sections": garbage}))
    assert "prime-node" in text_of(render({}))


def test_the_role_section_shows_the_pinned_trainer_and_every_trainer_announcing_the_run() -> None:
    attacker = "0x" + "ef" * 20
    role = {
        "role": "none",
        "reason": "run demo: no trainer pinned, so this node follows none and takes no role",
        "trainer": None,
        "announcements": [
            {"run": f"demo@{attacker}", "followed": False, "announcements": 3, "last_seen_s": 1.2},
            {"run": f"demo@{TRAINER}", "followed": True, "announcements": 9, "last_seen_s": 0.4},
            "garbage",
            {"run": 7, "followed": "yes"},
        ],
    }
    text = text_of(render(document(sections={"role": role})))
    assert "none pinned" in text
    assert f"demo@{attacker} not followed, 3 announcements, last 1 s ago" in text
    assert f"demo@{TRAINER} followed, 9 announcements, last 0 s ago" in text
    assert text.count("announced by") == 2  # rows without a run are skipped, never an exception
    pinned = text_of(render(document(sections={"role": {**role, "trainer": TRAINER}})))
    assert re.search(rf"trainer +{TRAINER}", pinned)


def test_availability_bar_and_sparkline() -> None:
    assert availability_bar([0, 1, 2, 3, 4, 10]).plain == "·░▒▓██"
    assert len(availability_bar(list(range(1000))).plain) == 64
    assert availability_bar(list(range(128))).plain[0] == "·"  # a bin shows its rarest piece
    assert sparkline([]) == "" and sparkline([1.0, 1.0]) == "▄▄"
    assert sparkline([0.0, 1.0]) == "▁█" and len(sparkline([float(i) for i in range(1000)])) == 48


def test_prometheus_lines_for_sections() -> None:
    text = prometheus_text(document())
    for line in (
        'prime_node_role{role="inferer"} 1',
        "prime_node_role_since_s 42",
        "prime_node_rollouts_produced 12",
        'prime_node_rollouts_rejected{reason="stale"} 2',
        'prime_node_validation_rejected{reason="proof_mismatch"} 2',
        "prime_node_validation_mean_validate_s 0.42",
        "prime_node_training_reward_curve_last 0.5",
        "prime_node_training_held_out_last 0.4",
        f'prime_node_training_accepted_by_worker{{key="{WORKER}"}} 20',
        'prime_node_checkpoint_have{step="4"} 120',
        "prime_node_checkpoints_bytes_in 5242880",
        "prime_node_weird_count 7",
    ):
        assert line in text.splitlines(), line
    assert text.count("# TYPE prime_node_rollouts_rejected gauge") == 1


def test_swarm_view() -> None:
    worker = document(
        address=WORKER, sections={"role": {"role": "validator", "reason": "validator: backlog 9 >= 8"}}
    )
    worker["name"] = "validator-1"
    text = text_of(render_swarm([document(), worker, {"name": "inferer-2", "error": "unreachable"}, {}, 5]))  # type: ignore[list-item]
    assert "(5 nodes)" in text
    assert "validator-1" in text and "backlog 9 >= 8" in text
    assert "v4 120/200 fetching" in text
    assert "step 5: 20 batches trained / 3 refused" in text
    assert "rollouts 12 made, 9 ok / 2 refused" in text
    assert "inferer-2" in text and "unreachable" in text
    assert "reward" in text and sparkline([0.1 * i for i in range(6)]) in text
    assert "(0 nodes)" in text_of(render_swarm([]))


known_keys = st.sampled_from(
    [
        "role",
        "reason",
        "since_s",
        "profile",
        "gpus",
        "versions",
        "availability",
        "step",
        "have",
        "pieces",
        "state",
        "rejected",
        "reward_curve",
        "held_out",
        "accepted_by_worker",
        "backlog",
        "error",
        "bytes_in",
    ]
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
# Keys are mostly the ones the views look for, so the deep paths get odd values too.
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=5)
        | st.dictionaries(known_keys | st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)
section_names = st.sampled_from(["role", "checkpoints", "rollouts", "validation", "training", "other"])
sections_strategy = st.dictionaries(section_names | st.text(max_size=10), json_values, max_size=6)


@given(sections_strategy, st.one_of(st.none(), sections_strategy))
def test_render_never_raises_on_any_sections(sections: dict[str, Any], before: dict[str, Any] | None) -> None:
    previous = None if before is None else document(sections=before)
    text = text_of(render(document(sections=sections), previous, 1.5), width=100)
    given_text = json.dumps([sections, before])
    for name in ("dict", "list", "NoneType", "bool", "int", "float", "str"):  # values, never type names
        assert f"({name})" not in text or f"({name})" in given_text
    text_of(render_swarm([document(sections=sections), {"sections": before}]), width=100)


@given(st.dictionaries(st.text(max_size=12), json_values, max_size=10))
def test_render_never_raises_on_any_document(doc: dict[str, Any]) -> None:
    text_of(render(doc, doc, 1.0), width=80)
    text_of(render_swarm([doc]), width=80)


_LABEL = r'[a-z]+="([^"\\\n]|\\.)*"'
_SAMPLE = re.compile(rf"^prime_node_[a-z0-9_]+(\{{{_LABEL}(,{_LABEL})*\}})? -?[0-9][0-9.e+-]*$")


@given(sections_strategy)
def test_prometheus_lines_stay_well_formed(sections: dict[str, Any]) -> None:
    lines = prometheus_text(document(sections=sections)).splitlines()
    seen_types = set()
    for line in lines:
        if line.startswith("# TYPE "):
            name = line.split()[2]
            assert name not in seen_types
            seen_types.add(name)
        elif not line.startswith("#"):
            assert _SAMPLE.match(line), line
    assert len(lines) < 2000
