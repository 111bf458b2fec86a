"""A run that ends without ``close()`` loses no step: a script that ends, raises or is sent SIGTERM (with
the handler docs/observe.md#close shows) has every completed step in its run file, under the default
governor (whose unsampled steps wait in the step log) and with ``every=1``.

Each case runs ``tests/scripts/exit_train.py`` in a child process, which prints every completed step
and its loss; the run file must hold exactly those steps with exactly those losses. Before, a Watch
left open lost what was still in its step log and channel: 84 of 300 steps under the governor.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamwatch.sinks import read_run
from tests.cli import env

SCRIPT = Path(__file__).resolve().parent / "scripts" / "exit_train.py"
TIMEOUT_S = 120


def _printed(stdout: str) -> dict[int, float]:
    """The steps the script completed (``STEP LOSS`` lines, the loss as ``float.hex``)."""
    steps = {}
    for line in stdout.splitlines():
        step, loss = line.split()
        steps[int(step)] = float.fromhex(loss)
    return steps


def _recorded(path: Path) -> dict[int, float]:
    """Every step in the run file, with its loss."""
    frame = read_run(path).to_pandas()
    steps = frame["step"].tolist()
    assert len(steps) == len(set(steps)), "a step recorded twice"
    return dict(zip(steps, frame["loss"].tolist(), strict=True))


def _run(path: Path, how: str, every: str | None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(SCRIPT), str(path), how, *([every] if every else [])]
    return subprocess.run(args, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("every", [None, "1"], ids=["governor", "every1"])
def test_a_script_that_ends_without_close_has_every_step_in_its_run_file(tmp_path: Path, every: str) -> None:
    """The Watch is a local of the script's ``main()``: collected when it returns, closed at exit."""
    done = _run(tmp_path / "run.swr", "end", every)
    assert done.returncode == 0, done.stderr
    printed = _printed(done.stdout)
    assert sorted(printed) == list(range(300))
    assert _recorded(tmp_path / "run.swr") == printed
    assert "streamwatch" not in done.stderr  # (closed quietly: nothing failed)


@pytest.mark.parametrize("every", [None, "1"], ids=["governor", "every1"])
def test_a_script_that_raises_has_every_completed_step_in_its_run_file(tmp_path: Path, every: str) -> None:
    done = _run(tmp_path / "run.swr", "raise", every)
    assert done.returncode == 1
    assert "RuntimeError: the training loop failed" in done.stderr
    printed = _printed(done.stdout)
    assert sorted(printed) == list(range(151))
    assert _recorded(tmp_path / "run.swr") == printed


def _sigterm(args: list[str], after: int = 200) -> tuple[int, str, str]:
    """Run ``python *args``, send it SIGTERM once it printed ``after`` lines (200 steps done: past the
    governor's calibration); its exit code, everything it printed, and its stderr."""
    proc = subprocess.Popen(
        [sys.executable, *args], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(after)]
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rest, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, "".join(lines) + rest, stderr


def test_sigterm_as_system_exit_has_every_completed_step_in_its_run_file(tmp_path: Path) -> None:
    """SIGTERM (a preemption, a scheduler's stop) with the one-line handler docs/observe.md#close shows:
    the run exits with 143 and every step it completed is in the run file (the step under way when the
    signal came is not a completed step: it may be missing)."""
    path = tmp_path / "run.swr"
    code, output, stderr = _sigterm([str(SCRIPT), str(path), "sigterm"])
    assert code == 128 + signal.SIGTERM, stderr
    printed = _printed(output)
    last = max(printed)
    assert sorted(printed) == list(range(last + 1))
    recorded = _recorded(path)
    assert sorted(recorded) in (list(range(last + 1)), list(range(last + 2)))
    assert {step: recorded[step] for step in printed} == printed


def test_a_sink_failing_when_closed_at_exit_is_reported_and_the_run_file_is_complete(tmp_path: Path) -> None:
    done = _run(tmp_path / "run.swr", "failing", "1")
    assert done.returncode == 0
    assert f"streamwatch: closing the Watch made at {SCRIPT}:" in done.stderr
    assert "OSError: the disk went away" in done.stderr
    assert _recorded(tmp_path / "run.swr") == _printed(done.stdout)


def test_lightning_stopped_by_sigterm_has_every_completed_step_in_its_run_file(tmp_path: Path) -> None:
    """Lightning turns SIGTERM into the end of the fit itself (its signal connector): the callback's run
    file holds every optimizer step the fit completed, with its loss, under the default governor."""
    pytest.importorskip("lightning.pytorch")
    code, output, stderr = _sigterm([str(SCRIPT.parent / "lightning_sigterm.py"), str(tmp_path)])
    assert code == 0, stderr
    assert "Received SIGTERM" in stderr
    stopped = [line for line in output.splitlines() if line.startswith("stopped at")]
    assert len(stopped) == 1
    printed = _printed("\n".join(line for line in output.splitlines() if not line.startswith("stopped")))
    assert sorted(printed) == list(range(int(stopped[0].split()[-1])))
    assert _recorded(tmp_path / "run.jsonl") == printed


def test_a_transformers_train_that_raises_has_every_completed_step_in_its_run_file(tmp_path: Path) -> None:
    """The Hugging Face Trainer has no event for a failed ``train()``: the callback's Watch stays open,
    and the script ends with the exception. Its run file holds every optimizer step the Trainer completed
    (before: 99 of the 120, under the default governor)."""
    pytest.importorskip("transformers")
    args = [sys.executable, str(SCRIPT.parent / "transformers_crash.py"), str(tmp_path)]
    done = subprocess.run(args, env=env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1
    assert "RuntimeError: the training step failed" in done.stderr
    printed = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert printed == list(range(120))
    assert sorted(read_run(tmp_path / "run.jsonl").to_pandas()["step"]) == printed
