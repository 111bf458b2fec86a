#!/usr/bin/env python3
"""Module and class sizes of the package, against the limits docs/architecture.md states.

``make lint`` runs it: it prints the largest modules and classes and exits 1 when one is past its limit
(tests/test_structure.py checks the same). Lines are physical lines, docstrings and comments included:
what a reader scrolls through.

    python .ci/sizes.py [PACKAGE_DIR]
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

MODULE_LIMIT = 900
"""Lines a module may have (a module past ~400 is a candidate for a split along its seams)."""
CLASS_LIMIT = 550
"""Lines a class may have (~500 is the aim; past it, a class holds more than one job)."""
OBSERVE_LIMIT = 800
"""Lines of ``_observe.py``, the wiring: its jobs live in the modules it wires."""
SHOWN = 8


@dataclass(frozen=True)
class Size:
    what: str  # "module" or "class"
    name: str
    lines: int
    limit: int


def measure(package: Path) -> list[Size]:
    """Every module's and every top-level class's size under ``package``."""
    found: list[Size] = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(package.parent))
        limit = OBSERVE_LIMIT if path.name == "_observe.py" else MODULE_LIMIT
        found.append(Size("module", name, len(text.splitlines()), limit))
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                found.append(Size("class", f"{name}:{node.name}", lines, CLASS_LIMIT))
    return found


def problems(found: list[Size]) -> list[str]:
    """One line per module or class past its limit."""
    return [
        f"{s.what} {s.name}: {s.lines} lines, past its limit of {s.limit}" for s in found if s.lines > s.limit
    ]


def main() -> int:
    package = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "streamwatch"
    found = measure(package)
    for what in ("module", "class"):
        largest = sorted((s for s in found if s.what == what), key=lambda s: -s.lines)[:SHOWN]
        print(f"largest {what}s (limit {largest[0].limit if largest else '-'}):")
        for s in largest:
            print(f"  {s.lines:5d}  {s.name}")
    bad = problems(found)
    for line in bad:
        print(f"error: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
