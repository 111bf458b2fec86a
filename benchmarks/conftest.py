"""Shared benchmark fixtures.

``bench_report`` lets a benchmark add lines to a section printed at the end of the run, after
pytest-benchmark's own table: the place for numbers that table has no column for (ratios to a baseline
measured in the same run, per-step costs). The same numbers also go to ``benchmark.extra_info``, which
``--benchmark-json`` saves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_REPORT = pytest.StashKey[list[str]]()

# benchmarks/gpu/ is one script and its helpers (make bench-gpu), not a benchmark; its module names (run,
# harness) are also divergence/'s, and --doctest-modules would import both pairs under one name each.
collect_ignore = ["gpu"]


@pytest.fixture
def bench_report(request: pytest.FixtureRequest) -> list[str]:
    """A list of lines printed under "benchmark report" in the terminal summary."""
    return request.config.stash.setdefault(_REPORT, [])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("benchmark report")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--benchmark-disable`` every benchmark here is skipped, saying why, instead of failing: each
    one reads its own timings (``benchmark.stats``, ratios to a baseline timed in the same run), which
    pytest-benchmark does not take when disabled."""
    if not config.getoption("benchmark_disable", default=False):
        return
    skip = pytest.mark.skip(
        reason="the benchmarks read their own timings, which --benchmark-disable does not take: run them "
        "with --benchmark-only (make bench)"
    )
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:  # (this hook sees the whole session's items: only ours)
            item.add_marker(skip)
