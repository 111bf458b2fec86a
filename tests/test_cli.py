"""The command line in a subprocess, as a user runs it: ``python -m streamwatch demo`` trains, serves
/metrics (scraped here while it runs) and writes a run file that reads back; ``report`` summarises it;
bad input gives one clear error line and exit status 2, never a traceback."""

from __future__ import annotations

import math
import re
import signal
import socket
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamwatch.cli import build_parser
from tests import cli
from tests.cli import ROOT

_streamwatch = cli.streamwatch


@pytest.fixture(autouse=True)
def _no_child_left() -> Iterator[None]:
    yield
    cli.reap()  # (a test that failed or timed out part way: its demo killed, not left running)


@pytest.mark.timeout(120)
def test_demo_serves_metrics_while_it_trains_and_writes_a_run_file(tmp_path: Path) -> None:
    from streamwatch.sinks import read_run

    run_dir = tmp_path / "run"
    args = [
        "demo",
        "--no-live",
        "--steps",
        "120",
        "--port",
        "0",
        "--run-dir",
        str(run_dir),
        "--linger",
        "600",
    ]
    proc = _streamwatch(*args, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        lines = []
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, f"the demo ended early: {''.join(lines)}{proc.stderr.read() if proc.stderr else ''}"
            lines.append(line)
            match = re.search(r"serving (http://127\.0\.0\.1:\d+/metrics)", line)
            if match:
                url = match.group(1)
        while "training done" not in line:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "streamwatch_loss{" in body
        assert 'run="demo"' in body
        assert re.search(r"streamwatch_step\{[^}]*\} \d+\.0", body)
        assert re.search(r"streamwatch_sampling_interval\{[^}]*\} \d+\.0", body)  # the default: a governor
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C during the linger: a clean end
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    text = "".join(lines) + out
    assert "interrupted" not in text  # Ctrl-C after training ends the linger, not the training
    assert f"stopped serving {url}" in text
    assert f"for 600 s more (Ctrl-C ends it): curl {url}" in text
    done = re.search(r"done: 120 steps, (\d+) records, 0 dropped", text)
    assert done, text
    assert "synthetic data" in text
    assert re.search(r"step +120 +loss", text), text
    # the log line: the governor's interval and what it measured against the default 2 % budget
    logged = re.findall(r"sampled 1 in (\d+) \(measured overhead (—|\d+\.\d%), budget 2\.0%\)", text)
    assert len(logged) == 3, text  # steps 50, 100 and 120
    assert all(int(interval) >= 1 for interval, _ in logged)
    run = read_run(run_dir)  # (the run directory, as the CLI takes it)
    # the governor samples step 0 and then one step in N (the records with layer rows); the run file has
    # every step, each with its loss, the unsampled ones carried by the next record
    assert [r.step for r in run.records] == list(range(120))
    assert all(math.isfinite(r.scalars["loss"]) for r in run.records)
    # each log line shows its own step's loss (not the last record's, up to a second old)
    shown = {int(s): v for s, v in re.findall(r"step +(\d+) +loss +(\S+)", text)}
    assert sorted(shown) == [50, 100, 120]
    assert shown == {s: f"{run.records[s - 1].scalars['loss']:.4f}" for s in shown}
    sampled = [r.step for r in run.records if r.keys]
    assert sampled[0] == 0
    assert 1 < len(sampled) <= int(done.group(1)) < 120
    assert not run.truncated


def test_report_summarises_a_recorded_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    demo = _streamwatch(
        "demo",
        "--no-live",
        "--every",
        "1",
        "--steps",
        "30",
        "--port",
        "0",
        "--run-dir",
        str(run_dir),
        "--linger",
        "0",
        cwd=tmp_path,
    )
    out, err = demo.communicate(timeout=100)
    assert demo.returncode == 0, err
    assert "done: 30 steps, 30 records, 0 dropped" in out
    assert re.search(r"step +30 +loss .* ms/step  sampled 1 in 1\n", out), out  # a fixed interval: no budget
    report = _streamwatch("report", str(run_dir), cwd=tmp_path)
    out, err = report.communicate(timeout=60)
    assert report.returncode == 0, err
    assert "29" in out  # the last step
    assert "loss" in out.lower()


def test_bad_input_is_one_clear_line_and_status_2(tmp_path: Path) -> None:
    missing = _streamwatch("report", str(tmp_path / "nowhere"), cwd=tmp_path)
    _, err = missing.communicate(timeout=60)
    assert missing.returncode == 2
    assert "no run directory or run file at" in err
    assert "Traceback" not in err
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    not_a_run = _streamwatch("report", str(empty_dir), cwd=tmp_path)
    _, err = not_a_run.communicate(timeout=60)
    assert not_a_run.returncode == 2
    assert "without a run file" in err
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        taken = _streamwatch(
            "demo",
            "--no-live",
            "--steps",
            "5",
            "--port",
            str(port),
            "--run-dir",
            str(tmp_path / "r"),
            cwd=tmp_path,
        )
        _, err = taken.communicate(timeout=100)
    assert taken.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in err
    assert "Traceback" not in err


def test_the_parser_has_the_documented_options() -> None:
    args = build_parser().parse_args(
        ["demo", "--steps", "7", "--port", "9500", "--hidden", "32", "--no-live"]
    )
    assert (args.steps, args.port, args.hidden, args.no_live) == (7, 9500, 32, True)
    assert (args.every, args.overhead) == (None, None)  # observe()'s default: the governor at 2 %
    assert build_parser().parse_args(["demo", "--overhead", "0.05"]).overhead == 0.05
    assert build_parser().parse_args(["demo", "--every", "3"]).every == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


@pytest.mark.timeout(120)
def test_live_view_replay_and_plot_from_the_command_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    demo = _streamwatch(
        "demo",
        "--every",
        "1",
        "--steps",
        "40",
        "--port",
        "0",
        "--run-dir",
        str(run_dir),
        "--linger",
        "0",
        cwd=tmp_path,
    )
    out, err = demo.communicate(timeout=100)
    assert demo.returncode == 0, err
    assert "40/40 steps" in out  # the live view's last frame
    assert "activation l2" in out
    assert "done: 40 steps, 40 records, 0 dropped" in out

    plot = _streamwatch("plot", str(run_dir), "-o", str(tmp_path / "run.png"), cwd=tmp_path)
    out, err = plot.communicate(timeout=100)
    assert plot.returncode == 0, err
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "run.png").stat().st_size > 20_000

    replay = _streamwatch("replay", str(run_dir), "--port", "0", "--speed", "0", cwd=tmp_path)
    try:
        assert replay.stdout is not None
        line = replay.stdout.readline()
        match = re.search(r"on (http://127\.0\.0\.1:\d+/metrics)", line)
        assert match, line
        url = match.group(1)
        while "replay done" not in line:
            line = replay.stdout.readline()
            assert line
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert re.search(r"streamwatch_step\{[^}]*\} 39\.0", body)
        assert "streamwatch_tensor_l2{" in body
    finally:
        replay.send_signal(signal.SIGINT)
        _, err = replay.communicate(timeout=60)
    assert replay.returncode == 0, err
    assert "Traceback" not in err


def test_version_names_the_distribution() -> None:
    """``streamwatch --version`` says the version and the name it is installed under (streamwatch-torch:
    ``streamwatch`` on the package index is someone else's project)."""
    import streamwatch

    proc = _streamwatch("--version", cwd=ROOT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == f"streamwatch {streamwatch.__version__} (streamwatch-torch)\n"


def test_demo_keeps_serving_long_enough_for_a_5s_scrape_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without the live view the demo serves /metrics 15 s after training (the README's sample run
    lasted about a second and /metrics closed with it: nothing for Prometheus to scrape); with the live
    view on a terminal, until Ctrl-C."""
    from streamwatch import cli

    slept: list[float] = []
    monkeypatch.setattr(cli, "_sleep", slept.append)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--no-live", "--steps", "3", "--port", "0"]) == 0
    out = capsys.readouterr().out
    assert slept == [cli.NO_LIVE_LINGER] == [15.0]
    url = re.search(r"serving (http://127\.0\.0\.1:\d+/metrics)", out)
    assert url, out
    assert f"training done; serving {url.group(1)} for 15 s more (Ctrl-C ends it): curl {url.group(1)}" in out
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert cli.main(["demo", "--steps", "3", "--port", "0"]) == 0
    assert slept[1:] == [math.inf]
    assert "until Ctrl-C: curl" in capsys.readouterr().out
