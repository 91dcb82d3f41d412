"""Imports go one way: crypto ← protocol ← prime_node; crypto and protocol do no I/O and read no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
IO_AND_CLOCK = {
    "trio",
    "libp2p",
    "torch",
    "transformers",
    "socket",
    "asyncio",
    "time",
    "subprocess",
    "requests",
    "httpx",
}
FORBIDDEN = {
    "crypto": {"protocol", "prime_node"} | IO_AND_CLOCK,
    "protocol": {"prime_node"} | IO_AND_CLOCK,
}


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_lower_layers(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no modules"
    violations = {
        str(path.relative_to(ROOT)): sorted(_imported_roots(path) & FORBIDDEN[package]) for path in files
    }
    assert {k: v for k, v in violations.items() if v} == {}


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import trio\nfrom prime_node.errors import NodeError\nfrom . import sibling\n")
    assert _imported_roots(module) == {"trio", "prime_node"}
