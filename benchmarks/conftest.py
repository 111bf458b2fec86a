"""Shared benchmark fixtures.

``bench_report`` lets a benchmark add lines to a section printed at the end of the run, after
pytest-benchmark's own table: the place for numbers that table has no column for (ratios to a baseline
measured in the same run, per-step costs). The same numbers also go to ``benchmark.extra_info``, which
``--benchmark-json`` saves.
"""

from __future__ import annotations

import pytest

_REPORT = pytest.StashKey[list[str]]()


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
