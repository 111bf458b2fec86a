"""The package's shape, read from its source: imports run one way (no circle, type-only imports
included), no module imports another module's private names, and modules and classes stay within the
sizes docs/architecture.md states (``.ci/sizes.py`` prints them in ``make lint``).

The import graph is built from every ``import`` and ``from ... import`` statement in the package,
wherever it stands (a function's lazy import or an ``if TYPE_CHECKING:`` block counts like any other):
a circle hidden behind a lazy import still ties the two modules into one unit of change.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "streamwatch"

_spec = importlib.util.spec_from_file_location("sizes", ROOT / ".ci" / "sizes.py")
assert _spec is not None
assert _spec.loader is not None
sizes = importlib.util.module_from_spec(_spec)
sys.modules["sizes"] = sizes
_spec.loader.exec_module(sizes)


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


MODULES = _modules()
COMPILED = {path.name.split(".")[0] for path in PACKAGE.glob("*.so")} | {"_fused"}
"""Extension modules built from C (``from streamwatch import _fused``): not Python source, no edges."""


def _owner(name: str) -> str:
    """The package module that defines ``name`` (a module, or the module an attribute comes from)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` for every streamwatch import in ``module``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                if f"{base}.{alias.name}" in MODULES:
                    found.append((f"{base}.{alias.name}", None, node.lineno))
                elif not (base == "streamwatch" and alias.name in COMPILED):
                    found.append((base, alias.name, node.lineno))
    return [(target, name, line) for target, name, line in found if target.split(".")[0] == "streamwatch"]


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for target, _, _ in _imports(module):
            owner = _owner(target)
            if owner != module:
                graph[module].add(owner)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_the_package_has_no_import_circle() -> None:
    assert _circles(_graph()) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names() -> None:
    """A name with a leading underscore belongs to its module: another module that needs it gets it under a
    public name (the module itself may still be private: ``streamwatch._record.StepRecord`` is fine,
    ``streamwatch._kernel._module_function`` is not)."""
    found = [
        f"{MODULES[module].relative_to(ROOT)}:{line}: {name} from {target}"
        for module in MODULES
        for target, name, line in _imports(module)
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    assert found == []


def test_module_and_class_sizes_are_within_the_limits() -> None:
    problems = sizes.problems(sizes.measure(PACKAGE))
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(("lines", "limit_hit"), [(10, False), (sizes.MODULE_LIMIT + 1, True)])
def test_the_size_check_finds_a_module_past_its_limit(tmp_path: Path, lines: int, limit_hit: bool) -> None:
    (tmp_path / "big.py").write_text("x = 1\n" * lines)
    assert bool(sizes.problems(sizes.measure(tmp_path))) is limit_hit
