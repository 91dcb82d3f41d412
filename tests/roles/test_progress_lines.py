"""The contributor's progress lines (issue 36: a home inferer's terminal was silent for the whole run)."""

from __future__ import annotations

import json

import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from prime_node.roles.progress import (
    Progress,
    ProgressReporter,
    progress_json,
    progress_line,
    progress_role,
    summary_line,
)

REASONS = st.sampled_from(["stale_policy", "sampling_mismatch", "bad_proof", "duplicate"])
PROGRESS = st.builds(
    Progress,
    role=st.sampled_from(["inferer", "validator", "seeder", "none"]),
    policy_held=st.none() | st.integers(0, 10**6),
    max_steps=st.none() | st.integers(0, 10**6),
    published=st.integers(0, 10**6),
    accepted=st.integers(0, 10**6),
    rejected=st.dictionaries(REASONS, st.integers(1, 10**4), max_size=4),
    validated=st.integers(0, 10**6),
    bytes_served=st.integers(0, 10**13),
)


@given(PROGRESS)
def test_a_line_names_the_role_the_policy_and_the_counts_and_never_a_python_type(progress: Progress) -> None:
    line = progress_line(progress)
    assert line.startswith(progress.role)
    assert "dict" not in line and "None" not in line and "\n" not in line
    if progress.policy_held is not None:
        assert f"policy {progress.policy_held}" in line
    if progress.role == "inferer":
        assert f"{progress.published} published" in line and f"{progress.accepted} accepted" in line
        assert f"{sum(progress.rejected.values())} rejected" in line
    assert ("the run has ended" in line) == progress.run_ended
    record = json.loads(progress_json(progress))
    assert record["event"] == "progress" and record["role"] == progress.role
    assert record["rejected"] == dict(progress.rejected) and record["run_ended"] == progress.run_ended


@given(PROGRESS, PROGRESS, st.floats(0, 10**6))
def test_the_summary_says_how_long_as_what_and_what_came_of_it(
    first: Progress, last: Progress, seconds: float
) -> None:
    line = summary_line(first, last, seconds)
    assert line.startswith("stopped after ") and f"as {last.role}" in line
    assert "served" in line and "None" not in line
    if last.published:
        assert f"{last.published} rollout batches published, {last.accepted} accepted" in line


def test_before_its_first_role_a_line_names_what_the_node_starts_as_not_seeder() -> None:
    """A ``--role validator`` node said ``seeder · no policy yet`` until its first checkpoint came."""
    assert progress_role(None, "validator") == "validator (starting)"
    assert progress_role(None, None) == "joining"
    assert progress_role("inferer", "validator") == "inferer"  # the running role is what it is
    line = progress_line(Progress(role=progress_role(None, "validator"), max_steps=10))
    assert line.startswith("validator (starting) · no policy yet")


def test_the_run_ends_only_once_its_last_policy_is_held() -> None:
    assert not Progress("inferer", policy_held=399, max_steps=400).run_ended
    assert Progress("inferer", policy_held=400, max_steps=400).run_ended
    assert not Progress("inferer", policy_held=None, max_steps=0).run_ended


async def test_the_reporter_speaks_on_news_at_most_once_an_interval_and_sums_up_when_stopped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    state = {"progress": None}
    lines: list[str] = []
    reporter = ProgressReporter(lambda: state["progress"], lines.append, interval_s=60)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reporter.run)
        await trio.sleep(10)
        assert lines == []  # nothing known yet: nothing said
        state["progress"] = Progress("inferer", policy_held=0, max_steps=3)
        await trio.sleep(2)
        assert lines == [progress_line(Progress("inferer", policy_held=0, max_steps=3))]
        for n in range(1, 30):  # news every second: still one line a minute
            state["progress"] = Progress("inferer", policy_held=1, max_steps=3, published=n, accepted=n)
            await trio.sleep(1)
        assert len(lines) == 1
        await trio.sleep(60)
        assert len(lines) == 2 and "29 published" in lines[-1]
        await trio.sleep(300)
        assert len(lines) == 2  # no news, no line
        state["progress"] = Progress("inferer", policy_held=3, max_steps=3, published=30, accepted=29)
        await trio.sleep(2)  # the run ending is said at once
        assert len(lines) == 3 and "the run has ended" in lines[-1]
        nursery.cancel_scope.cancel()
    assert lines[-1].startswith("stopped after 6 min") and "policies 0–3 received" in lines[-1]
    assert "30 rollout batches published, 29 accepted" in lines[-1]
