"""``streamwatch.live(watch)``: your own loop's progress — the live view on a terminal, log lines in a
notebook, a pipe, or without rich (``streamwatch._console``)."""

from __future__ import annotations

import io
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import streamwatch as sw

ROOT = Path(__file__).resolve().parents[1]


class Terminal(io.StringIO):
    """A file that says it is a terminal (rich then draws its live display)."""

    def isatty(self) -> bool:
        return True


def _train(steps: int, progress_of: Any, **live: Any) -> tuple[sw.Watch, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, every=1) as watch, progress_of(watch, **live) as progress:
        for _ in range(steps):
            x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss, outputs=logits, targets=y)
            watch.flush()
            progress.update()
    return watch, progress


def test_a_pipe_gets_a_log_line_every_n_steps_and_one_for_the_last() -> None:
    out = io.StringIO()
    _, progress = _train(5, sw.live, every=2, file=out, url="http://127.0.0.1:1/metrics")
    lines = out.getvalue().splitlines()
    assert progress.mode == "lines"
    assert lines[0] == "streamwatch: http://127.0.0.1:1/metrics"
    assert [line.split()[:2] for line in lines[1:]] == [["step", "2"], ["step", "4"], ["step", "5"]]
    assert all("loss" in line and "accuracy" in line and "sampled 1 in 1" in line for line in lines[1:])
    assert "nan" not in lines[-1].split("accuracy")[0]  # the latest loss, after a flush


def test_a_terminal_gets_the_live_view() -> None:
    pytest.importorskip("rich")
    out = Terminal()
    _, progress = _train(3, sw.live, total_steps=3, file=out)
    assert progress.mode == "live"
    text = out.getvalue()
    assert "3/3 steps" in text
    assert "activation l2" in text
    assert "\x1b[" in text  # drawn in place, with the terminal's escapes


def test_a_notebook_gets_log_lines_even_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    class ZMQInteractiveShell:  # what a Jupyter kernel's get_ipython() returns
        pass

    fake = types.ModuleType("IPython")
    fake.get_ipython = ZMQInteractiveShell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    out = Terminal()
    _, progress = _train(2, sw.live, every=1, file=out)
    assert progress.mode == "lines"
    assert [line.split()[:2] for line in out.getvalue().splitlines()[1:]] == [["step", "1"], ["step", "2"]]


def test_without_rich_a_terminal_gets_log_lines_and_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich", None)  # as if it were not installed
    out = Terminal()
    _, progress = _train(1, sw.live, every=1, file=out)
    assert progress.mode == "lines"
    first = out.getvalue().splitlines()[0]
    assert (
        first
        == "streamwatch (the live view needs rich: pip install 'streamwatch-torch[demo]'; printing log lines)"
    )


def test_steps_may_be_given_and_arguments_are_checked() -> None:
    out = io.StringIO()
    with sw.observe(torch.nn.Linear(2, 1)) as watch:
        with sw.live(watch, every=10, file=out) as progress:
            progress.update(10)
            progress.update(15)
        with pytest.raises(ValueError, match=r"^Expected `every` to be a positive integer, got 0$"):
            sw.live(watch, every=0)
        with pytest.raises(ValueError, match=r"^Expected `total_steps` to be an integer >= 0"):
            sw.live(watch, total_steps=-1)
    assert [line.split()[:2] for line in out.getvalue().splitlines()[1:]] == [["step", "10"], ["step", "15"]]


def test_live_imports_no_rich_when_it_prints_lines() -> None:
    code = (
        "import io, sys, torch, streamwatch as sw\n"
        "with sw.observe(torch.nn.Linear(2, 1)) as watch, sw.live(watch, file=io.StringIO()) as p:\n"
        "    watch.step(); p.update()\n"
        "assert 'rich' not in sys.modules, 'rich imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
