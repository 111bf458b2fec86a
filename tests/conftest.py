"""Shared fixtures."""

from __future__ import annotations

import pytest

from streamwatch import _kernel


@pytest.fixture(params=["fused", "torch"])
def summary_kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test once with the fused CPU kernel and once with the eager torch summaries.

    The fused kernel is built when the package is installed (``pip install -e .`` with a C compiler,
    CONTRIBUTING.md); a missing library fails here rather than silently testing the fallback twice.
    """
    if request.param == "torch":
        monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    else:
        monkeypatch.delenv("STREAMWATCH_KERNEL", raising=False)
        assert _kernel.load() is not None, _kernel.status()
    return str(request.param)
