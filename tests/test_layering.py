"""Imports go one way: crypto ← protocol ← prime_node; crypto and protocol do no I/O and read no clock."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from tests import import_graph as graph

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


# -- what the wheel ships: no test kit in production code, no dev-only dependency anywhere --------------

SHIPPED = ("crypto", "protocol", "prime_node")
TEST_KIT = "prime_node.testing"
# Everything but tests/ and benchmarks/ is production code, shipped in the wheel or run by users.
PRODUCTION = (*SHIPPED, "scripts", "examples")


def _dev_only_imports() -> set[str]:
    """Import names of the ``dev`` extra's packages that neither the install nor another extra needs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    needed = {*project["dependencies"], *(r for name, reqs in extras.items() if name != "dev" for r in reqs)}
    return {re.split(r"[<>=!~ \[;]", r)[0].lower().replace("-", "_") for r in set(extras["dev"]) - needed}


def _imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, fully qualified (``from a import b`` names both ``a`` and ``a.b``;
    relative imports resolved against the file's package)."""
    package = path.relative_to(root).parent.parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _imports_of(modules: set[str], names: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == n or m.startswith(f"{n}.") for n in names))


def _python_files(top_levels: tuple[str, ...]) -> list[Path]:
    files = sorted(path for top in top_levels for path in (ROOT / top).rglob("*.py"))
    assert files
    return files


def test_production_code_does_not_import_the_test_kit() -> None:
    """prime_node/testing ships for tests and benchmarks; the agent and its scripts never depend on it."""
    kit = ROOT / "prime_node" / "testing"
    violations = {
        str(path.relative_to(ROOT)): _imports_of(_imported_modules(path), {TEST_KIT})
        for path in _python_files(PRODUCTION)
        if not path.is_relative_to(kit)
    }
    assert {k: v for k, v in violations.items() if v} == {}


# The test kit sits on the core, not on the layers that assemble it: a helper that starts the CLI's node or
# the demo's processes belongs next to the tests that use it (tests/p2p/nat_peer.py, tests/p2p/nat_swarm.py).
TEST_KIT_MAY_NOT_IMPORT = ("prime_node.cli", "prime_node.demo", "prime_node.roles")


def _test_kit_imports_from_above(root: Path) -> list[str]:
    """Every import (at module level, in a function or under TYPE_CHECKING) of the test kit that names
    a package above the core."""
    files = graph.module_files(root, ("prime_node",))
    return sorted(
        {
            f"{files[imp.importer].relative_to(root)}:{imp.line} {imp.module}"
            for imp in graph.all_imports(files)
            if _in_package(imp.importer, TEST_KIT)
            and any(_in_package(imp.module, above) for above in TEST_KIT_MAY_NOT_IMPORT)
        }
    )


def test_the_test_kit_depends_only_on_the_core() -> None:
    assert _test_kit_imports_from_above(ROOT) == []


def test_the_test_kit_checker_sees_imports_from_above(tmp_path: Path) -> None:
    for package in ("", "testing", "cli", "demo", "roles"):
        (tmp_path / "prime_node" / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / "prime_node" / package / "__init__.py").write_text("")
    for module in ("cli/main", "demo/setup", "roles/runner", "node"):
        (tmp_path / "prime_node" / f"{module}.py").write_text("")
    (tmp_path / "prime_node" / "testing" / "peer.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from prime_node.node import x\n"
        "from prime_node.cli.main import app\n"
        "if TYPE_CHECKING:\n    from ..demo import setup\n"
        "def f():\n    import prime_node.roles.runner\n"
    )
    (tmp_path / "prime_node" / "cli" / "main.py").write_text("from prime_node.demo import setup\n")
    assert _test_kit_imports_from_above(tmp_path) == [
        "prime_node/testing/peer.py:3 prime_node.cli.main",
        "prime_node/testing/peer.py:5 prime_node.demo.setup",
        "prime_node/testing/peer.py:7 prime_node.roles.runner",
    ]


def test_nothing_the_wheel_ships_imports_a_dev_dependency() -> None:
    """The wheel installs without the ``dev`` extra: hypothesis strategies live in tests/strategies/."""
    dev_only = _dev_only_imports()
    assert {"hypothesis", "pytest", "eth_account"} <= dev_only
    violations = {
        str(path.relative_to(ROOT)): _imports_of(_imported_modules(path), dev_only)
        for path in _python_files(SHIPPED)
    }
    assert {k: v for k, v in violations.items() if v} == {}


def test_the_module_checker_sees_test_kit_and_dev_imports(tmp_path: Path) -> None:
    module = tmp_path / "prime_node" / "cli" / "m.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "import hypothesis.strategies as st\n"
        "from prime_node import testing\n"
        "from ..testing.adversary import build_scenario\n"
        "from . import sibling\n"
        "def f():\n    from pytest import raises\n"
    )
    modules = _imported_modules(module, root=tmp_path)
    assert _imports_of(modules, {TEST_KIT}) == [
        "prime_node.testing",
        "prime_node.testing.adversary",
        "prime_node.testing.adversary.build_scenario",
    ]
    assert _imports_of(modules, _dev_only_imports()) == ["hypothesis.strategies", "pytest", "pytest.raises"]
    assert "prime_node.cli.sibling" in modules
    clean = module.with_name("clean.py")
    clean.write_text(
        "import hypothesis_extra\nfrom prime_node.testing_notes import x\nfrom .testing import y\n"
    )
    assert _imports_of(_imported_modules(clean, root=tmp_path), {TEST_KIT, *_dev_only_imports()}) == []


# -- the sans-IO core touches no files and draws entropy in one place ----------------------------------

OS_ACCESS = {"os", "pathlib", "shutil", "tempfile", "secrets"}
ENTROPY_SOURCE = Path("crypto/randomness.py")  # the one module that may read the OS's CSPRNG


def _os_access(path: Path) -> set[str]:
    allowed = {"secrets"} if path.relative_to(ROOT) == ENTROPY_SOURCE else set()
    return (_imported_roots(path) & OS_ACCESS) - allowed


@pytest.mark.parametrize("package", ["crypto", "protocol"])
def test_the_core_does_not_reach_the_operating_system(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    violations = {str(path.relative_to(ROOT)): sorted(_os_access(path)) for path in files}
    assert {k: v for k, v in violations.items() if v} == {}
    assert (ROOT / ENTROPY_SOURCE).is_file()


def test_the_os_checker_sees_os_and_stray_entropy(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\nimport secrets\nfrom pathlib import Path\n")
    assert _imported_roots(module) & OS_ACCESS == {"os", "secrets", "pathlib"}


# -- no import cycles; imports inside functions only for heavy modules -----------------------------------

OURS = ("crypto", "protocol", "prime_node")
# Deferred imports exist for speed: `prime-node --help` imports none of these (tests/cli checks the first
# six), and a node that does not train never pays for the ML stack. Each costs ≳10 ms to import, or pulls
# in a native stack: torch/transformers/tokenizers/safetensors/numpy/pyarrow (the ML stack, seconds),
# libp2p/multiaddr (the network stack), trio, pydantic (the run config), rich (terminal UI), typer,
# coincurve/Crypto/blake3/msgpack (crypto/ and protocol/ import them: ~100 ms), h11, urllib (http.client,
# email, ssl: ~20 ms), platformdirs.
HEAVY_LIBRARIES = frozenset(
    {
        "torch",
        "transformers",
        "tokenizers",
        "safetensors",
        "numpy",
        "numba",
        "pyarrow",
        "libp2p",
        "multiaddr",
        "trio",
        "pydantic",
        "rich",
        "typer",
        "coincurve",
        "Crypto",
        "blake3",
        "msgpack",
        "h11",
        "urllib",
        "platformdirs",
    }
)
# prime_node/ml is the ML stack's package: only the commands and roles that run a model import it
# (ml/__init__.py), so a module outside it may defer an import of it even where torch itself is deferred.
HEAVY_PACKAGES = ("prime_node.ml",)


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(f"{package}.")


def _cheap_deferred_imports(root: Path, tops: tuple[str, ...]) -> list[str]:
    """Imports inside functions that load nothing heavy the module has not loaded already at its top:
    they belong at the top of the file. Counted per module: a module that imports trio (or anything of
    protocol/, which brings msgpack and coincurve) at its top gains nothing by deferring another module
    for trio's sake."""
    files = graph.module_files(root, tops)
    imports = graph.all_imports(files)
    executed: dict[str, set[str]] = {}

    def loads(module: str) -> set[str]:
        if module not in executed:
            executed[module] = graph.executed_at_import(module, imports, files)
        return executed[module]

    top_level = {
        (imp.importer, imp.module)
        for imp in imports
        if not imp.deferred and not imp.type_only and not imp.ours
    }
    cheap: list[str] = []
    for imp in imports:
        if not imp.deferred or imp.type_only:
            continue
        already = loads(imp.importer)
        if imp.ours:
            heavy = imp.module not in already and (
                bool((loads(imp.module) - already) & HEAVY_LIBRARIES)
                or any(
                    _in_package(imp.module, p)
                    and not _in_package(imp.importer, p)
                    and not any(_in_package(m, p) for m in already)
                    for p in HEAVY_PACKAGES
                )
            )
        else:
            root_name = imp.module.split(".")[0]
            loaded = (imp.importer, imp.module) in top_level or (
                imp.module == root_name and root_name in already
            )
            heavy = root_name in HEAVY_LIBRARIES and not loaded
        if not heavy:
            cheap.append(f"{files[imp.importer].relative_to(root)}:{imp.line} {imp.module}")
    return sorted(set(cheap))


def test_no_import_cycles_between_modules() -> None:
    """Deferred and TYPE_CHECKING imports count: a cycle hidden in a function is still a cycle."""
    assert graph.cycles(graph.module_graph(graph.all_imports(graph.module_files(ROOT, OURS)))) == []


def test_no_import_cycles_between_subpackages() -> None:
    """prime_node.ml ↔ prime_node.tasks and the like: each subpackage sits above or below another."""
    modules = graph.module_graph(graph.all_imports(graph.module_files(ROOT, OURS)))
    assert graph.cycles(graph.collapse(modules)) == []


def test_imports_inside_functions_are_only_for_heavy_modules() -> None:
    """Ruff's PLC0415 cannot tell a heavy module from a cheap one, so this is the allow-list."""
    assert _cheap_deferred_imports(ROOT, OURS) == []


ARCHITECTURE = ROOT / "docs" / "architecture.md"
TABLE_START, TABLE_END = "<!-- layer table: python -m tests.import_graph -->", "<!-- end of layer table -->"


def test_the_architecture_page_shows_the_layers_as_they_are() -> None:
    """docs/architecture.md's dependency table is the graph's: an import between subpackages that the page
    does not show fails here (paste the output of ``python -m tests.import_graph`` between the markers)."""
    text = ARCHITECTURE.read_text()
    shown = text[text.index(TABLE_START) + len(TABLE_START) : text.index(TABLE_END)].strip()
    assert shown == graph.layer_table(ROOT)


def test_the_layer_table_levels_a_planted_graph(tmp_path: Path) -> None:
    files = {
        "crypto/__init__.py": "",
        "crypto/keys.py": "",
        "protocol/__init__.py": "from crypto import keys\n",
        "prime_node/__init__.py": "",
        "prime_node/errors.py": "",
        "prime_node/low/__init__.py": "",
        "prime_node/low/a.py": "from prime_node.errors import E\nfrom protocol import x\n",
        "prime_node/high/__init__.py": "",
        "prime_node/high/b.py": "def f():\n    from prime_node.low import a\n",
        "prime_node/loop/__init__.py": "from prime_node.knot import k\n",
        "prime_node/knot/__init__.py": "",
        "prime_node/knot/k.py": "from prime_node.loop import y\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert graph.layer_table(tmp_path).splitlines()[2:] == [
        "| 0 | `crypto` | nothing else |",
        "| 0 | `errors` | nothing else |",
        "| 0 (cycle) | `knot` | `loop` |",
        "| 0 (cycle) | `loop` | `knot` |",
        "| 0 | `prime_node` | nothing else |",
        "| 1 | `protocol` | nothing else |",
        "| 2 | `low` | nothing else |",
        "| 3 | `high` | `low` |",
    ]


def test_the_graph_checker_sees_planted_cycles_and_cheap_deferred_imports(tmp_path: Path) -> None:
    def write(relative: str, text: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    write("pkg/__init__.py", "from pkg.a.one import ONE\n")  # a re-export is not a cycle
    write("pkg/a/__init__.py", "")
    write("pkg/a/one.py", "import json\nONE = 1\ndef f():\n    from pkg.a import two\n")
    write("pkg/a/two.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .one import ONE\n")
    write("pkg/a/three.py", "from pkg.b.four import FOUR\n")
    write("pkg/b/__init__.py", "")
    write("pkg/b/four.py", "import torch\nFOUR = 4\ndef g():\n    import os\n    import torch\n")
    write("pkg/b/five.py", "def h():\n    from pkg.a.one import ONE\n    from pkg.a.three import x\n")
    write("pkg/c/__init__.py", "")
    write("pkg/c/six.py", "import trio\nSIX = 6\n")
    write("pkg/c/seven.py", "import trio\ndef k():\n    from pkg.c.six import SIX\n    import trio\n")
    write("pkg/c/eight.py", "def m():\n    from pkg.c.six import SIX\n")
    # A script's own run (``if __name__ == "__main__":``) is not what importing the module loads.
    write("pkg/c/nine.py", 'def n():\n    import torch\nif __name__ == "__main__":\n    import torch\n')
    files = graph.module_files(tmp_path, ("pkg",))
    modules = graph.module_graph(graph.all_imports(files))
    assert graph.cycles(modules) == [["pkg.a.one", "pkg.a.two"]]
    assert graph.cycles(graph.collapse(modules)) == [["pkg.a", "pkg.b"]]
    assert _cheap_deferred_imports(tmp_path, ("pkg",)) == [
        "pkg/a/one.py:4 pkg.a.two",
        "pkg/b/five.py:2 pkg.a.one",
        "pkg/b/four.py:4 os",
        "pkg/b/four.py:5 torch",
        "pkg/c/seven.py:3 pkg.c.six",
        "pkg/c/seven.py:4 trio",
    ]
