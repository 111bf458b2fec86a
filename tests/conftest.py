"""Shared fixtures."""

from __future__ import annotations

import pytest

from streamwatch import _kernel


@pytest.fixture(params=["fused", "torch"])
def summary_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once with the fused CPU kernel and once with the eager torch summaries.

    The fused kernel needs a C compiler; the test suite requires one (README, Development), so a
    missing compiler fails here rather than silently testing the fallback twice.
    """
    if request.param == "torch":
        monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    else:
        monkeypatch.delenv("STREAMWATCH_KERNEL", raising=False)
        assert _kernel.load() is not None, _kernel.status()
    return str(request.param)
