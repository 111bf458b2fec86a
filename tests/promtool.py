"""``promtool check metrics`` for tests: skipped without promtool, unless ``STREAMWATCH_REQUIRE_PROMETHEUS=1``
(CI sets it), which makes a missing promtool a failure."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REQUIRE_ENV = "STREAMWATCH_REQUIRE_PROMETHEUS"


def check_metrics(body: str | bytes) -> None:
    """Assert that ``promtool check metrics`` accepts ``body`` without an error or a lint warning."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail("needs promtool (the Debian package prometheus)")
        pytest.skip("needs promtool (the Debian package prometheus)")
    data = body.encode() if isinstance(body, str) else body
    check = subprocess.run(
        [promtool, "check", "metrics"], input=data, capture_output=True, timeout=60, check=False
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert not check.stdout.strip(), check.stdout.decode()
    assert not check.stderr.strip(), check.stderr.decode()


def lint_problems(body: str | bytes) -> list[str]:
    """What ``promtool check metrics`` says about ``body`` (sorted lines; it must not fail to parse)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail("needs promtool (the Debian package prometheus)")
        pytest.skip("needs promtool (the Debian package prometheus)")
    data = body.encode() if isinstance(body, str) else body
    check = subprocess.run(
        [promtool, "check", "metrics"], input=data, capture_output=True, timeout=60, check=False
    )
    text = check.stdout.decode() + check.stderr.decode()
    assert "error while linting" not in text, text
    return sorted(line for line in text.splitlines() if line.strip())
