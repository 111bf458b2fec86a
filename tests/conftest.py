"""Shared fixtures."""

from __future__ import annotations

import os

import torch

# The Triton kernels (streamwatch/_triton_kernels.py) run on CPU tensors under the Triton interpreter
# where there is no GPU: it is chosen when the kernels are defined, so before anything imports them
# (tests/test_triton.py, doctest collection of the package).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

from streamwatch import _kernel
from tests import training

# Property tests explore new examples on every run, except under HYPOTHESIS_PROFILE=ci (.ci/run), where
# each test draws the same examples every time: a submission's CI is red for a change, never for a
# draw. Bugs found by exploring are pinned as @example cases.
settings.register_profile("ci", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


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


@pytest.fixture
def train() -> training.Train:
    """The tests' training loop, ``tests.training.train``: real optimizer steps under a watch.

    ``train(model, opt, watch, steps, *, data=None, shape=(8, 4), classes=3, seed=None, generator=None,
    loss=default_loss, report_outputs=True, before_opt_step=None, after_opt_step=None,
    after_watch_step=None, flush=False) -> list[float]`` (the losses); see ``tests/training.py``::

        def test_something(train):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with sw.observe(model, opt) as watch:
                train(model, opt, watch, 3, shape=(16, 6), seed=1)  # 16 samples, 6 features, 3 classes
    """
    return training.train


WATCHED = ("STREAMWATCH_", "TRITON_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_")
"""Environment variables collection must leave alone: streamwatch's, Triton's, and those that make torch,
Accelerate and the Trainers take the process for a rank of a distributed job."""

_ENVIRONMENT = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
"""Those variables as the session began (``TRITON_INTERPRET`` set above)."""


def pytest_collection_finish(session: pytest.Session) -> None:
    """Collecting must not change streamwatch's or Triton's environment: ``--doctest-modules`` imports
    every file under the test paths (``tests/scripts/`` included), and a variable one of them set at
    import reached every test and every child process after it (``STREAMWATCH_KERNEL=triton`` once sent
    the command-line tests' demos through the Triton interpreter, which timed them out; ``RANK``,
    ``LOCAL_RANK`` and ``WORLD_SIZE`` once made every later in-process Trainer a distributed one)."""
    now = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
    if now != _ENVIRONMENT:
        changed = sorted(k for k in now.keys() | _ENVIRONMENT.keys() if now.get(k) != _ENVIRONMENT.get(k))
        raise pytest.UsageError(
            f"importing the tests changed the environment: {changed}; set it in a function"
        )
