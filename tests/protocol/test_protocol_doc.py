"""docs/protocol.md is the wire specification, and this keeps it true (DESIGN §9; issue 36).

The page has a section per message type (``### `name` ``) with a table of its fields in encoding order,
each with its type and bounds in the notation of protocol/wire_schema.py, a ``cap`` line and a ``travels``
line; and transport tables (gossip topics, stream protocols, data-plane contexts, envelope domains, limits).
Everything is compared with the codec's own schemas and the constants in the code, so a field, a message
type, a topic, a stream protocol or a domain kind added without a line on the page fails here. A failure
prints the rows the page should have.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import protocol
from prime_node.dataplane.channel import DEFAULT_CONTEXT
from prime_node.dataplane.libp2p_stream import fallback_protocol
from prime_node.node.gossip import REPAIR_PROTOCOL, topic_name
from prime_node.node.neighbour_links import NEIGHBOUR_PROTOCOL
from prime_node.p2p.libp2p_build import GOSSIPSUB_PROTOCOL
from prime_node.p2p.nat import DIALBACK_PROTOCOL
from prime_node.roles.announcement import RUN_PROTOCOL
from protocol import topics
from protocol.codec import WIRE_VERSION, Message, registered_types
from protocol.envelope import Domain
from protocol.probe import PROBE_PROTOCOL
from protocol.rollout_transfer import ROLLOUT_CONTEXT
from protocol.wire_schema import FieldSpec, message_fields, size_text

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
SOURCES = ("protocol", "prime_node", "crypto")
NOT_SCANNED = ("prime_node/testing/",)
"""The test kit's own protocols (a NAT test's echo) are no part of the wire."""
TRANSPORT_WORDS = ("gossip", "stream", "data plane", "inside")

for _module in pkgutil.walk_packages(protocol.__path__, prefix="protocol."):
    importlib.import_module(_module.name)


def wire_types() -> dict[str, type[Message]]:
    """Every message type the project's codec knows (test-only types registered by other tests left out)."""
    return {name: cls for name, cls in registered_types().items() if cls.__module__.startswith("protocol.")}


# -- reading the page ------------------------------------------------------------------------------------


@dataclass
class Section:
    level: int
    title: str
    lines: list[str]


def sections(text: str) -> list[Section]:
    """The page cut at its headings (fenced code is not searched for headings)."""
    found: list[Section] = [Section(0, "", [])]
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^(#{1,6}) (.*)$", line)
        if heading:
            found.append(Section(len(heading[1]), heading[2].strip(), []))
        else:
            found[-1].lines.append(line)
    return found


def message_sections(text: str) -> tuple[dict[str, list[str]], list[str]]:
    """``### `name` `` sections by message name, and the names documented more than once."""
    out: dict[str, list[str]] = {}
    repeated = []
    for section in sections(text):
        named = re.match(r"^`([a-z0-9_.]+)`", section.title)
        if section.level == 3 and named:
            if named[1] in out:
                repeated.append(named[1])
            out[named[1]] = section.lines
    return out, repeated


def titled(text: str, title: str) -> list[str]:
    """The lines of the one section whose heading is ``title``."""
    matches = [s.lines for s in sections(text) if s.title == title]
    assert len(matches) == 1, f"docs/protocol.md needs exactly one section titled {title!r}"
    return matches[0]


def table(lines: list[str]) -> list[list[str]]:
    """The first markdown table in ``lines``: its rows (header and rule left out), cells stripped."""
    rows: list[list[str]] = []
    for line in lines:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def plain(cell: str) -> str:
    return cell.replace("`", "").strip()


def first_column(lines: list[str]) -> set[str]:
    return {plain(row[0]) for row in table(lines)}


def keyed_line(lines: list[str], key: str) -> str | None:
    """The text after ``- **key**:`` in a message section."""
    for line in lines:
        found = re.match(rf"^- \*\*{key}\*\*: (.*)$", line)
        if found:
            return found[1]
    return None


def transports(travels: str) -> Iterator[tuple[str, str]]:
    """(kind, name) for every ``gossip `topic```, ``stream `/id` ``, ``data plane `context` `` and
    ``inside `message` `` a travels line names."""
    yield from re.findall(r"(gossip|stream|data plane|inside) `([^`]+)`", travels)


def size_value(text: str) -> int | None:
    """The number of bytes ``64 MiB + 1 KiB`` says, or None if the text is not a size."""
    units = {"MiB": 1 << 20, "KiB": 1 << 10, "B": 1}
    parts = [p.strip() for p in text.split("+")]
    total = 0
    for part in parts:
        found = re.fullmatch(r"(\d+) (MiB|KiB|B)", part)
        if not found:
            return None
        total += int(found[1]) * units[found[2]]
    return total


# -- what the code says ----------------------------------------------------------------------------------


def code_topics() -> set[str]:
    return {value for name, value in vars(topics).items() if name.endswith("_TOPIC")}


def code_contexts() -> set[str]:
    return {DEFAULT_CONTEXT, ROLLOUT_CONTEXT}


def code_stream_protocols() -> set[str]:
    ours = {NEIGHBOUR_PROTOCOL, REPAIR_PROTOCOL, RUN_PROTOCOL, PROBE_PROTOCOL, DIALBACK_PROTOCOL}
    return ours | {GOSSIPSUB_PROTOCOL} | {fallback_protocol(context) for context in code_contexts()}


KIND_CONSTANTS = {
    "CHECKPOINT_KIND": "protocol.manifest",
    "VERDICT_KIND": "protocol.verdict",
    "RUN_KIND": "protocol.run_announcement",
    "ROLLOUT_KIND": "prime_node.verification.validator",
}


def source_files() -> Iterator[tuple[str, str]]:
    for package in SOURCES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if not relative.startswith(NOT_SCANNED):
                yield relative, path.read_text()


def code_domain_kinds() -> set[str]:
    """Every kind a ``Domain(...)`` in the code is built with: string literals as they are, constants
    through ``KIND_CONSTANTS`` (a constant the table does not know fails: add it there)."""
    kinds: set[str] = set()
    unknown = []
    for relative, source in source_files():
        for first in re.findall(r"\bDomain\(\s*([^,)]+)", source):
            literal = re.fullmatch(r"[\"']([^\"']+)[\"']", first.strip())
            if literal:
                kinds.add(literal[1])
            elif first.strip() in KIND_CONSTANTS:
                module = importlib.import_module(KIND_CONSTANTS[first.strip()])
                kinds.add(getattr(module, first.strip()))
            elif relative != "protocol/envelope.py":  # the class itself (``cls(...)``, signatures)
                unknown.append(f"{relative}: Domain({first.strip()}, ...)")
    assert not unknown, f"domain kinds this test cannot resolve (add them to KIND_CONSTANTS): {unknown}"
    return kinds


def resolve(dotted: str) -> Any:
    """``package.module.NAME`` or ``package.module.Class.attr``: the value in the code."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            value = getattr(value, attr)
        return value
    raise AssertionError(f"{dotted} names nothing in the code")


# -- checks, as functions of the page's text (the self-tests below feed them broken pages) ----------------


def expected_table(cls: type[Message]) -> str:
    rows = [f"| `{f.name}` | {f.type} | … |" for f in message_fields(cls)]
    return "\n".join(["| field | type | meaning |", "| --- | --- | --- |", *rows])


def field_problems(text: str) -> list[str]:
    """Each message's table must list exactly the codec's fields, in order, with the codec's types."""
    documented, _ = message_sections(text)
    problems = []
    for name, cls in sorted(wire_types().items()):
        if name not in documented:
            continue  # section_problems reports it
        rows = table(documented[name])
        found = [FieldSpec(plain(row[0]), plain(row[1])) for row in rows if len(row) >= 2]
        if found != list(message_fields(cls)):
            problems.append(f"`{name}`: the page has {found}, the codec encodes:\n{expected_table(cls)}")
    return problems


def section_problems(text: str) -> list[str]:
    documented, repeated = message_sections(text)
    problems = [f"`{name}` is documented twice" for name in repeated]
    types = wire_types()
    problems += [
        f"no section `### \\`{name}\\`` for a message the codec knows"
        for name in types.keys() - documented.keys()
    ]
    problems += [
        f"a section for `{name}`, which the codec does not know" for name in documented.keys() - types.keys()
    ]
    return problems


def cap_problems(text: str) -> list[str]:
    documented, _ = message_sections(text)
    problems = []
    for name, cls in sorted(wire_types().items()):
        if name not in documented:
            continue
        cap = keyed_line(documented[name], "cap")
        said = None if cap is None else size_value(cap.split(" — ")[0])
        if said != cls.MAX_BYTES:
            problems.append(
                f"`{name}`: cap line says {cap!r}, the codec's cap is `- **cap**: {size_text(cls.MAX_BYTES)}`"
            )
    return problems


def travel_problems(text: str) -> list[str]:
    """Each message says where it travels, and only on transports that exist: gossip topics, stream
    protocols and data-plane contexts of the code, or inside a message that can hold it."""
    documented, _ = message_sections(text)
    types = wire_types()
    known = {
        "gossip": code_topics(),
        "stream": code_stream_protocols(),
        "data plane": code_contexts(),
        "inside": set(types),
    }
    problems = []
    for name in sorted(types.keys() & documented.keys()):
        travels = keyed_line(documented[name], "travels")
        named = list(transports(travels or ""))
        if not named:
            problems.append(
                f"`{name}` has no `- **travels**:` line naming a gossip topic, stream, data plane or message"
            )
        for kind, where in named:
            if where not in known[kind]:
                problems.append(f"`{name}` travels on {kind} `{where}`, which the code does not have")
            elif kind == "inside" and not _can_hold(types[where], types[name]):
                problems.append(f"`{name}` travels inside `{where}`, which has no field that can hold it")
    return problems


def _can_hold(outer: type[Message], inner: type[Message]) -> bool:
    """A field of ``outer`` is ``inner`` (as a record, or an array of them) or bytes (an encoded frame)."""
    return any(
        re.match(r"^\[?bytes", spec.type) or re.search(rf"(^|\[){re.escape(inner.TYPE)}(\]|$)", spec.type)
        for spec in message_fields(outer)
    )


def transport_problems(text: str) -> list[str]:
    """The transport tables name exactly the code's topics, stream protocols, contexts and domain kinds,
    and every one of them is used by some message's travels line (or says what it carries)."""
    problems = []
    for title, code in (
        ("Gossip topics", code_topics()),
        ("Stream protocols", code_stream_protocols()),
        ("Data-plane contexts", code_contexts()),
        ("Envelope domains", code_domain_kinds()),
    ):
        documented = first_column(titled(text, title))
        if documented != code:
            problems.append(
                f"{title}: the page lists {sorted(documented)}, the code has {sorted(code)} "
                f"(missing: {sorted(code - documented)}, not in the code: {sorted(documented - code)})"
            )
    return problems


def signed_problems(text: str) -> list[str]:
    """``- **signed**: `kind` `` lines name real domain kinds, and every kind signs some message."""
    documented, _ = message_sections(text)
    kinds = code_domain_kinds()
    used = set()
    problems = []
    for name in sorted(documented):
        signed = keyed_line(documented[name], "signed")
        if signed is None:
            continue
        for kind in re.findall(r"`([^`]+)`", signed.split(" — ")[0]):
            used.add(kind)
            if kind not in kinds:
                problems.append(f"`{name}` is signed as `{kind}`, a domain kind the code does not use")
    if kinds - used:
        problems.append(f"domain kinds no message section says it is signed as: {sorted(kinds - used)}")
    return problems


def limit_problems(text: str) -> list[str]:
    """Each row of the *Limits* table: a constant of the code and its value (a size or a number)."""
    problems = []
    rows = table(titled(text, "Limits"))
    if not rows:
        problems.append("the Limits table is empty")
    for row in rows:
        dotted, said = plain(row[0]), plain(row[1])
        value = resolve(dotted)
        parsed: float | None = size_value(said)
        if parsed is None:
            try:
                parsed = float(said)
            except ValueError:
                parsed = None
        if parsed is None or parsed != value:
            shown = size_text(value) if isinstance(value, int) and value >= 1024 else value
            problems.append(f"Limits: `{dotted}` is {said!r} on the page, {shown} in the code")
    return problems


def form_problems(text: str) -> list[str]:
    """The name forms the page gives are the ones the code builds."""
    forms = {
        "gossip topic": topic_name("<run>", "<name>"),
        "envelope domain": str(Domain("kind", "run")).replace("/kind/run", "/<kind>/<run>"),
        "data-plane fallback": fallback_protocol("<context>"),
        "frame": f"[{WIRE_VERSION}, type, [field, ...]]",
    }
    return [
        f"the page should show the {what} as `{form}`"
        for what, form in forms.items()
        if f"`{form}`" not in text
    ]


CHECKS = (
    section_problems,
    field_problems,
    cap_problems,
    travel_problems,
    signed_problems,
    transport_problems,
    limit_problems,
    form_problems,
)


@pytest.fixture(scope="module")
def page() -> str:
    return DOC.read_text()


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_the_wire_spec_matches_the_code(page: str, check: Any) -> None:
    problems = check(page)
    assert not problems, "docs/protocol.md is stale:\n" + "\n".join(problems)


# -- the checks catch what they are for --------------------------------------------------------------------


def _without_line(text: str, fragment: str) -> str:
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if fragment in line]
    assert len(hits) == 1, f"{fragment!r} should be on exactly one line of the page"
    return "\n".join(lines[: hits[0]] + lines[hits[0] + 1 :])


def test_a_field_without_a_line_fails(page: str) -> None:
    assert field_problems(_without_line(page, "| `verified_groups` |"))


def test_fields_out_of_order_fail(page: str) -> None:
    lines = page.splitlines()
    total = next(i for i, line in enumerate(lines) if line.startswith("| `total_size` |"))
    lines[total - 1], lines[total] = lines[total], lines[total - 1]
    assert field_problems("\n".join(lines))


def test_a_wrong_bound_fails(page: str) -> None:
    assert field_problems(page.replace("| `domain` | str≤160 |", "| `domain` | str≤161 |", 1))


def test_a_message_without_a_section_fails(page: str) -> None:
    assert section_problems(page.replace("### `probe.done`", "### probe done", 1))


def test_a_wrong_cap_fails(page: str) -> None:
    assert cap_problems(page.replace("- **cap**: 64 MiB + 1 KiB", "- **cap**: 8 MiB + 1 KiB", 1))


def test_a_made_up_transport_fails(page: str) -> None:
    stale = page.replace("stream `/prime-node/neighbour/2`", "stream `/prime-node/heartbeat/1`")
    assert travel_problems(stale)


def test_a_missing_topic_or_domain_fails(page: str) -> None:
    assert transport_problems(_without_line(page, "| `verdicts` |"))
    assert transport_problems(_without_line(page, "| `peer_record` |"))


def test_a_wrong_limit_fails(page: str) -> None:
    assert limit_problems(
        page.replace(
            "| `protocol.provider_duty.PROVIDERS` | 8 |", "| `protocol.provider_duty.PROVIDERS` | 20 |"
        )
    )
