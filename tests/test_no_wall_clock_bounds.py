"""No test bounds the wall clock (issue 31): a time limit or a count that depends on how fast this machine
is, or how its tasks were scheduled, fails on a loaded or slower machine while the code is right.
Figures like that belong in benchmarks/. What a test may do with real time: guard against a hang with a
deadline (a loop's ``deadline``, ``fail_after``, a wait's ``timeout``), at ten times or more what the
step takes; an ``assert`` that reads the clock for that says so with ``# hang guard`` on its line.
Tests under trio's virtual clock (``autojump_clock``) measure protocol time, not this machine, and may
bound it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {("time", "monotonic"), ("time", "perf_counter"), ("time", "time"), ("trio", "current_time")}
ELAPSED_NAMES = {"took", "elapsed", "waited", "seconds", "duration", "wall_s", "baseline"}
VIRTUAL_CLOCK = ("autojump_clock", "MockClock")
MARK = "# hang guard"


def _reads_clock(node: ast.AST, derived: frozenset[str] = frozenset()) -> bool:
    for child in ast.walk(node):
        if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute):
            owner = child.func.value
            if isinstance(owner, ast.Name) and (owner.id, child.func.attr) in CLOCKS:
                return True
        if isinstance(child, ast.Name) and (child.id in ELAPSED_NAMES or child.id in derived):
            return True
    return False


def _clock_arithmetic(value: ast.AST, names: frozenset[str]) -> bool:
    """A clock reading, an elapsed name, or sums and scalings of them (not any expression naming one:
    ``due = policy(seconds=seconds)`` is no time)."""
    if isinstance(value, ast.BinOp):
        return _clock_arithmetic(value.left, names) or _clock_arithmetic(value.right, names)
    if isinstance(value, ast.UnaryOp):
        return _clock_arithmetic(value.operand, names)
    if isinstance(value, ast.Name):
        return value.id in ELAPSED_NAMES or value.id in names
    return isinstance(value, ast.Call) and _reads_clock(value) and not value.args and not value.keywords


def _clock_names(tree: ast.AST) -> frozenset[str]:
    """Names assigned from a clock reading, or from another such name (``stopped_after = time.monotonic()
    - signalled``): whatever they are called, they are elapsed times. A ``deadline`` is not one."""
    assigned = [
        (target.id, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name) and "deadline" not in target.id
    ]
    names: frozenset[str] = frozenset()
    while True:
        grown = names | {name for name, value in assigned if _clock_arithmetic(value, names)}
        if grown == names:
            return names
        names = grown


def _is_deadline(node: ast.AST) -> bool:
    return any(isinstance(child, ast.Name) and "deadline" in child.id for child in ast.walk(node))


def _bounds_from_above(left: ast.AST, op: ast.cmpop, right: ast.AST, derived: frozenset[str]) -> bool:
    """``elapsed < bound`` or ``bound > elapsed`` (or an equality): what a slower machine breaks. A lower
    bound (a sleep lasted at least its time) holds on any machine; a ``deadline`` is a hang guard."""
    if isinstance(op, ast.Gt | ast.GtE):
        left, right = right, left
    elif not isinstance(op, ast.Lt | ast.LtE | ast.Eq):
        return False
    return _reads_clock(left, derived) and not _is_deadline(right)


def wall_clock_bounds(path: Path) -> list[str]:
    """``path:line`` of every assert that compares a clock reading or an elapsed time to a bound."""
    source = path.read_text()
    if any(word in source for word in VIRTUAL_CLOCK):
        return []
    lines = source.splitlines()
    found = []
    tree = ast.parse(source, filename=str(path))
    derived = _clock_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in (c for c in ast.walk(node.test) if isinstance(c, ast.Compare)):
            operands = [compare.left, *compare.comparators]
            pairs = zip(operands, compare.ops, operands[1:], strict=False)
            bounded = any(_bounds_from_above(*pair, derived) for pair in pairs)
            if bounded and MARK not in lines[node.lineno - 1]:
                found.append(f"{path}:{node.lineno}")
    return found


def test_no_assert_bounds_the_wall_clock() -> None:
    offenders = [hit for path in sorted(TESTS.rglob("*.py")) for hit in wall_clock_bounds(path)]
    advice = "move the figure to benchmarks/, or mark a true hang guard"
    assert offenders == [], f"{advice}: " + ", ".join(o.removeprefix(f"{TESTS.parent}/") for o in offenders)


def test_the_rule_sees_a_bound_and_lets_a_hang_guard_pass(tmp_path: Path) -> None:
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import time\n"
        "def test_bound():\n"
        "    started = time.monotonic()\n"
        "    took = time.monotonic() - started\n"
        "    assert took <= 2.0\n"
        "    assert time.monotonic() - started < 5\n"
        "    deadline = time.monotonic() + 60\n"
        "    assert time.monotonic() < deadline\n"
        "    assert time.monotonic() - started < 600  # hang guard: 10 x the step\n"
        "    assert 0.5 <= time.monotonic() - started\n"
        "    assert 0.5 <= took < 5\n"
        "    assert 5 > took\n"
        "    stopped_after = time.monotonic() - started\n"
        "    late = stopped_after * 2\n"
        "    assert stopped_after < 15\n"
        "    assert late <= 30\n"
        "    assert time.monotonic() - started < 600  # hang guard: 10 x the step\n"
    )
    hits = [hit.rsplit(":", 1)[1] for hit in wall_clock_bounds(sample)]
    assert hits == ["5", "6", "11", "12", "15", "16"]
