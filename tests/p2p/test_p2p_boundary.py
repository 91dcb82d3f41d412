"""py-libp2p is used in exactly one module boundary (prime_node/p2p/), and never at import time elsewhere."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports_libp2p(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        if any(name.split(".")[0] in {"libp2p", "multiaddr"} for name in names):
            return True
    return False


def test_only_the_p2p_package_imports_libp2p() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("prime_node", "protocol", "crypto")
        for path in (ROOT / package).rglob("*.py")
        if _imports_libp2p(path) and not path.is_relative_to(ROOT / "prime_node" / "p2p")
    ]
    assert offenders == []


def test_the_node_cli_does_not_load_libp2p_until_a_command_runs() -> None:
    code = "import sys, prime_node.cli.main as m; m.build_app(); print('libp2p' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
