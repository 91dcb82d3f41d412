"""The import graph of our packages, read from the source with ast, for tests/test_layering.py.

Every import counts, at module level or inside a function, except those under ``if TYPE_CHECKING:``
when we ask what a module executes; an ``if __name__ == "__main__":`` block counts as deferred. An edge
goes to the most specific module of ours an import names (``from a import b`` is ``a.b`` when that is a
module, else ``a``). Running a package's ``__init__``
before its submodule is not an edge: a package that re-exports its submodules is not a cycle.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Import:
    importer: str
    module: str  # fully qualified: ours resolved to a module file, anything else as written
    ours: bool
    deferred: bool  # inside a function body
    type_only: bool  # under ``if TYPE_CHECKING:``
    line: int


def module_files(root: Path, tops: Iterable[str]) -> dict[str, Path]:
    """Module name → file, for every .py file under ``root/top`` (``pkg/__init__.py`` is ``pkg``)."""
    found: dict[str, Path] = {}
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_main_guard(test: ast.expr) -> bool:
    """``if __name__ == "__main__":``: runs when the module is a script, never when it is imported."""
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(name: str, path: Path, ours: Mapping[str, Path]) -> list[Import]:
    """Every import statement in module ``name`` (file ``path``), one Import per imported name."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: list[Import] = []

    def resolve(module: str, member: str | None) -> tuple[str, bool]:
        for candidate in ([f"{module}.{member}"] if member else []) + [module]:
            if candidate in ours:
                return candidate, True
        return module, False

    def visit(node: ast.AST, deferred: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for inner in child.body:
                    visit_statement(inner, deferred, True)
                for inner in child.orelse:
                    visit_statement(inner, deferred, type_only)
            elif isinstance(child, ast.If) and _is_main_guard(child.test):
                for inner in child.body:  # a script's own run, like a function body
                    visit_statement(inner, True, type_only)
            else:
                visit_statement(child, deferred, type_only)

    def visit_statement(node: ast.AST, deferred: bool, type_only: bool) -> None:
        targets: list[tuple[str, str | None]] = []
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            targets = [(module, alias.name) for alias in node.names]
        for module, member in targets:
            resolved, is_ours = resolve(module, member)
            found.append(Import(name, resolved, is_ours, deferred, type_only, getattr(node, "lineno", 0)))
        inner_deferred = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        visit(node, inner_deferred, type_only)

    visit(ast.parse(path.read_text(), filename=str(path)), False, False)
    return found


def all_imports(files: Mapping[str, Path]) -> list[Import]:
    return [imp for name, path in files.items() for imp in imports_of(name, path, files)]


def module_graph(imports: Iterable[Import]) -> dict[str, set[str]]:
    """Module → the modules of ours it imports, at any depth and under TYPE_CHECKING too."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.ours and imp.module != imp.importer:
            graph.setdefault(imp.importer, set()).add(imp.module)
    return graph


def subpackage_of(module: str) -> str:
    """``prime_node.ml.engine`` → ``prime_node.ml``; a top-level module (``prime_node.errors``) is its own."""
    return ".".join(module.split(".")[:2])


def collapse(
    graph: Mapping[str, set[str]], unit_of: Callable[[str], str] = subpackage_of
) -> dict[str, set[str]]:
    """The graph between units (subpackages by default); imports inside one unit drop out."""
    collapsed: dict[str, set[str]] = {}
    for importer, targets in graph.items():
        for target in targets:
            if unit_of(importer) != unit_of(target):
                collapsed.setdefault(unit_of(importer), set()).add(unit_of(target))
    return collapsed


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def executed_at_import(module: str, imports: Iterable[Import], files: Mapping[str, Path]) -> set[str]:
    """Every module (ours and third-party roots) that importing ``module`` runs: module-level imports,
    not TYPE_CHECKING ones, followed through our modules and the packages that contain them."""
    runtime: dict[str, list[Import]] = {}
    for imp in imports:
        if not imp.deferred and not imp.type_only:
            runtime.setdefault(imp.importer, []).append(imp)
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in files]
        for imp in runtime.get(current, []):
            if imp.ours:
                todo.append(imp.module)
            else:
                seen.add(imp.module.split(".")[0])
    return seen


def layer_of(module: str) -> str:
    """The unit docs/architecture.md's table lists: ``crypto``, ``protocol``, or a subpackage (or top-level
    module) of prime_node without the ``prime_node.`` prefix (``prime_node/__init__`` is ``prime_node``)."""
    parts = module.split(".")
    return parts[0] if parts[0] != "prime_node" or len(parts) == 1 else parts[1]


def layer_table(root: Path, tops: Iterable[str] = ("crypto", "protocol", "prime_node")) -> str:
    """docs/architecture.md's dependency table, from the graph: each unit, its level (0 imports nothing of
    ours; otherwise one above the highest unit it imports) and what it imports besides the three roots
    every layer may use (crypto, protocol, errors). A unit in a cycle is marked, not levelled."""
    files = module_files(root, tops)
    graph = collapse(module_graph(all_imports(files)), layer_of)
    in_cycle = {unit for component in cycles(graph) for unit in component}
    levels: dict[str, int] = {}

    def level(unit: str) -> int:
        if unit not in levels:
            levels[unit] = 0  # a cycle ends here instead of recursing forever
            below = [level(target) for target in graph.get(unit, ()) if target not in in_cycle]
            levels[unit] = 1 + max(below, default=-1)
        return levels[unit]

    common = {"crypto", "protocol", "errors"}
    rows = ["| level | unit | imports (besides crypto, protocol, errors) |", "|---|---|---|"]
    for unit in sorted({layer_of(m) for m in files}, key=lambda u: (level(u), u)):
        shown = f"{level(unit)}" + (" (cycle)" if unit in in_cycle else "")
        imports = ", ".join(f"`{t}`" for t in sorted(graph.get(unit, set()) - common)) or "nothing else"
        rows.append(f"| {shown} | `{unit}` | {imports} |")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m tests.import_graph: the table docs/architecture.md shows
    print(layer_table(Path(__file__).resolve().parent.parent))
