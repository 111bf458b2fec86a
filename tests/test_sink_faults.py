"""Sinks that fail in every way, during real training: a failing sink stops only its own pipeline, is
counted and reported, the worker thread never dies of it and training never hangs; close() is bounded."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch.sinks import RunFile
from tests.threads import JOIN_S, spawn, wait_until
from tests.training import Step, train

STEPS = 8


class Boom(Exception):
    pass


class Broken(sw.Sink):
    """A sink whose ``send`` raises ``error`` (from record ``at`` on), and whose ``fail`` and ``close`` raise
    again."""

    def __init__(self, error: BaseException, at: int = 2) -> None:
        self.error, self.at = error, at

    def send(self, item: Any) -> None:
        if item.step >= self.at:
            raise self.error

    def fail(self, error: BaseException) -> None:
        raise Boom("fail() raised too")

    def close(self) -> None:
        raise Boom("close() raised too")

    def __repr__(self) -> str:
        return "<broken>"


class ClosesBadly(sw.Sink):
    """Takes every record, then raises in ``close``."""

    def send(self, item: Any) -> None:
        pass

    def close(self) -> None:
        raise Boom("close() raised")

    def __repr__(self) -> str:
        return "<closes badly>"


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _latest_step(watch: sw.Watch) -> float | None:
    return next((s.value for s in watch.snapshot() if s.name == "streamwatch_step"), None)


def _train(model: nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch, steps: int) -> None:
    """Real training; after every step, the snapshot must reach that step (it never freezes)."""

    def reached(_: Step) -> None:
        step = watch.statistics().steps - 1  # the one just taken
        wait_until(lambda: _latest_step(watch) == step, f"snapshot() reaches step {step}")

    train(model, opt, watch, steps, after_watch_step=reached)


@pytest.fixture
def immutable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory in which nothing can be created, even by root, once ``chattr +i`` froze it."""
    folder = tmp_path / "frozen"
    folder.mkdir()
    yield folder
    if shutil.which("chattr") is not None:
        subprocess.run(["chattr", "-i", str(folder)], check=False)


def _faulty(kind: str, folder: Path) -> tuple[sw.Sink, Callable[[], None], str]:
    """A sink that fails at write time, what to do once it is attached, and its error's pattern."""
    if kind == "dev-full":
        return RunFile("/dev/full"), lambda: None, r"No space left on device"
    if kind == "immutable-dir":
        sink = RunFile(folder / "run.jsonl")  # writable when built, frozen before the first step

        def freeze() -> None:
            if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode:
                pytest.skip("chattr +i is not supported here")

        return sink, freeze, r"Operation not permitted"
    if kind == "send-fail-close-raise":
        return Broken(Boom("send() raised")), lambda: None, r"Boom: send\(\) raised"
    if kind == "send-raises-system-exit":
        return Broken(SystemExit(3)), lambda: None, r"SystemExit: 3"
    if kind == "close-raises":
        return ClosesBadly(), lambda: None, r"Boom: close\(\) raised"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    ["dev-full", "immutable-dir", "send-fail-close-raise", "send-raises-system-exit", "close-raises"],
)
@pytest.mark.parametrize("overflow", ["block", "drop_oldest"])
def test_a_failing_sink_stops_only_itself_and_never_hangs_training(
    kind: str, overflow: str, immutable_dir: Path
) -> None:
    model, opt = _model()
    sink, arm, pattern = _faulty(kind, immutable_dir)
    healthy = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[sink, healthy], overflow=overflow, capacity=2, every=1)  # type: ignore[arg-type]
    arm()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = spawn(_train, model, opt, watch, STEPS)
        trainer.finish()  # fails (instead of hanging) if training stalls in watch.step()
        closer = spawn(watch.close)
        with pytest.raises(sw.PipelineError, match=pattern) as info:
            closer.finish()
    failed = repr(sw.source() | sink)
    assert [name for name, _ in info.value.errors] == [failed]
    assert str(info.value).startswith("1 pipeline failed on the worker thread and was stopped")
    assert [r.step for r in healthy.items] == list(range(STEPS))  # the other sink got every record
    assert healthy.closed
    assert healthy.error is None
    stats = watch.statistics()
    assert stats.pipeline_failures == 1
    assert stats.records_received == STEPS
    assert _latest_step(watch) == STEPS - 1
    if kind != "close-raises":  # a failure during training is warned about at the next step()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1, messages
        assert messages[0].startswith("streamwatch: 1 pipeline failed on the worker thread")
        assert failed in messages[0]
    if isinstance(sink, Broken):  # the second error is kept with the first, not lost
        notes = getattr(info.value.__cause__, "__notes__", [])
        assert any("fail() raised too" in note for note in notes), notes


CHILD = textwrap.dedent(
    """
    import json, resource, signal, sys, warnings
    import torch
    import streamwatch as sw

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run, healthy = sw.sinks.RunFile(sys.argv[1]), sw.sinks.collect()
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    warnings.simplefilter("ignore")
    watch = sw.observe(model, opt, sinks=[run, healthy], overflow="block", capacity=2, every=1)
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 3, (8,)))
        opt.zero_grad(); loss.backward(); opt.step()
        watch.step(loss=loss)
    try:
        watch.close()
        error = None
    except sw.PipelineError as err:
        error = f"{type(err.__cause__).__name__}: {err.__cause__}"
    stats = watch.statistics()
    print(json.dumps({"error": error, "failures": stats.pipeline_failures,
                      "healthy": [r.step for r in healthy.items], "received": stats.records_received}))
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="needs resource.RLIMIT_FSIZE")
def test_a_file_size_limit_stops_only_the_run_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"training hung once the run file hit the size limit: {hung.stderr!r}")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["error"].startswith("OSError: [Errno 27] File too large"), result
    assert result["failures"] == 1
    assert result["healthy"] == list(range(40))
    assert result["received"] == 40
    assert 0 < path.stat().st_size <= 4096


# -- close() is bounded ---------------------------------------------------------------------------------


class Stuck(sw.Sink):
    """A sink whose ``send`` never returns (until the test lets it go)."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def send(self, item: Any) -> None:
        self.entered.set()
        self.release.wait()

    def __repr__(self) -> str:
        return "<stuck>"


@pytest.fixture
def stuck() -> Iterator[Stuck]:
    sink = Stuck()
    yield sink
    sink.release.set()  # let the abandoned worker thread finish


@pytest.mark.parametrize("where", ["observe", "close"])
def test_close_gives_up_on_a_sink_that_never_returns(stuck: Stuck, where: str) -> None:
    model, opt = _model()
    healthy = sw.sinks.collect()
    if where == "observe":
        watch = sw.observe(model, opt, sinks=[healthy, stuck], close_timeout=0.2, every=1)
    else:
        watch = sw.observe(model, opt, sinks=[healthy, stuck], every=1)
    train(model, opt, watch, 1, report_outputs=False)
    assert stuck.entered.wait(JOIN_S)  # the worker is inside the stuck sink with step 0
    train(model, opt, watch, 2, report_outputs=False)  # steps 1, 2 wait in the channel (training does not)
    started = time.monotonic()
    close = watch.close if where == "observe" else lambda: watch.close(timeout=0.2)
    with pytest.warns(RuntimeWarning) as caught:
        spawn(close).finish()  # returns: no PipelineError, nothing else failed
    assert time.monotonic() - started < JOIN_S
    message = str(caught[0].message)
    stuck_pipeline = repr(sw.source() | stuck)
    assert message.startswith("streamwatch: close() gave up after 0.2 s"), message
    assert f"{stuck_pipeline} did not return" in message
    assert "3 records were not flushed to every sink" in message
    assert "left running" in message
    stats = watch.statistics()
    assert stats.stuck_pipelines == (stuck_pipeline,)
    assert stats.unflushed_records == 3
    assert stats.pipeline_failures == 0
    assert [r.step for r in healthy.items] == [0]  # step 0 reached the sink before the stuck one only
    watch.close()  # idempotent and quiet
    stuck.release.set()  # the abandoned thread finishes on its own once the sink returns
    wait_until(lambda: healthy.closed, "the abandoned worker drains and closes the other sinks")
    assert [r.step for r in healthy.items] == [0, 1, 2]


def test_close_gives_up_in_time_with_block_and_a_full_channel_and_an_evaluation_to_send(stuck: Stuck) -> None:
    # overflow="block": close() hands over the evaluation pass run after the last step; with the channel
    # full behind a stuck sink, that send waited forever (no timeout) before close() ever got to give up
    model, opt = _model()
    watch = sw.observe(model, opt, sinks=[stuck], overflow="block", capacity=2, every=1)
    train(model, opt, watch, 1, report_outputs=False)
    assert stuck.entered.wait(JOIN_S)  # step 0 is in the stuck sink
    train(model, opt, watch, 2, report_outputs=False)  # steps 1 and 2 fill the channel
    with torch.no_grad():
        model.eval()
        model(torch.randn(4, 4))  # a final evaluation pass: close() sends it as a record of its own
    started = time.monotonic()
    with pytest.warns(RuntimeWarning) as caught:
        spawn(lambda: watch.close(timeout=0.5)).finish()
    elapsed = time.monotonic() - started
    assert elapsed < JOIN_S  # (the wait is the timeout once: the send and the worker share it)
    message = str(caught[0].message)
    assert message.startswith("streamwatch: close() gave up after 0.5 s"), message
    assert "4 records were not flushed to every sink" in message  # steps 0-2 and the evaluation record
    stats = watch.statistics()
    assert stats.unflushed_records == 4
    assert stats.pipeline_failures == 0


def test_close_waits_as_long_as_the_sinks_are_working() -> None:
    model, opt = _model()
    slow = sw.sinks.callback(lambda record: time.sleep(0.05))
    watch = sw.observe(model, opt, sinks=[slow], overflow="block", close_timeout=math.inf, every=1)
    train(model, opt, watch, 4, report_outputs=False)
    watch.close(timeout=None)  # the observe() default: here, forever
    stats = watch.statistics()
    assert stats.records_received == 4
    assert (stats.stuck_pipelines, stats.unflushed_records) == ((), 0)


@pytest.mark.parametrize("timeout", [0, -1.0, math.nan, True, "30"], ids=repr)
def test_a_bad_close_timeout_is_refused(timeout: object) -> None:
    model, opt = _model()
    message = r"^Expected `close_timeout` to be a number of seconds > 0 \(math.inf waits forever\), got "
    with pytest.raises(ValueError, match=message):
        sw.observe(model, opt, close_timeout=timeout, every=1)  # type: ignore[arg-type]
    with (
        sw.observe(model, opt, every=1) as watch,
        pytest.raises(ValueError, match=message.replace("close_", "")),
    ):
        watch.close(timeout=timeout)  # type: ignore[arg-type]
    assert watch.closed  # refused before closing anything: the with block then closed it
