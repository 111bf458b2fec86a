"""Bad input to the command line, as a user gives it: every case is one line on stderr, starting with
``streamwatch <command>: error:``, and exit status 2 — never a traceback, never a busy core, never a run
directory left behind by a demo that did not start.

Most cases call :func:`streamwatch.cli.main` in this process (argparse's ``SystemExit`` included) and
read what it printed; the ones that need a real process (a port held by another socket, CPU time of a
replay) run ``python -m streamwatch`` in a subprocess."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamwatch import SeriesKey, StepRecord
from streamwatch.cli import main
from streamwatch.sinks import RunFile, read_run
from streamwatch.sinks._runformat import FORMAT, VERSION
from streamwatch.testing import table
from tests import cli

_streamwatch = cli.streamwatch
_env = cli.env
HEADER = json.dumps({"format": FORMAT, "version": VERSION, "columns": ["count"], "created": 0.0})
DEEP = "[" * 100_000

try:
    import matplotlib  # noqa: F401

    HAVE_MATPLOTLIB = True
except ImportError:  # pragma: no cover - matplotlib is in the test environment
    HAVE_MATPLOTLIB = False


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``main(argv)`` as the console script runs it: (exit status, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_error_line(code: int, err: str, command: str | None) -> str:
    """Status 2 and one line on stderr: ``streamwatch <command>: error: ...`` (``command`` None: the
    subcommand's name or none, as argparse reports an unrecognised argument on the main parser)."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    prefix = rf"streamwatch {command}: error: " if command else r"streamwatch( \w+)?: error: "
    assert re.match(prefix, lines[0]), err
    return lines[0]


@pytest.fixture(autouse=True)
def _no_child_left() -> Iterator[None]:
    yield
    cli.reap()  # (a test that failed or timed out part way: its child killed, not left running)


def _write_run(path: Path, steps: int) -> Path:
    """A real run file with ``steps`` small step records (or just its header, for 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sink = RunFile(path)
    key = SeriesKey("train", "fc", "param_grad", "weight")
    for step in range(steps):
        row = table(count=8, sum=2.0, sumsq=6.0, min=-1.0, max=2.0, zeros=1, nonfinite=float("nan"), fill=0)
        sink.send(StepRecord(step, float(step), 0, (key,), row, {"loss": 1.0 / (step + 1)}))
    sink.close()
    return path


# --- 1. numeric options: rejected by the parser, one line, status 2 -----------------------------------

# a valid demo the bad option overrides
_DEMO = ["demo", "--no-live", "--steps", "2", "--port", "0", "--linger", "0"]

BAD_OPTIONS = [
    [*_DEMO, "--log-every", "0"],
    [*_DEMO, "--log-every", "-1"],
    [*_DEMO, "--steps", "0"],
    [*_DEMO, "--steps", "-5"],
    [*_DEMO, "--steps", "many"],
    [*_DEMO, "--steps", "2.5"],
    [*_DEMO, "--hidden", "0"],
    [*_DEMO, "--layers", "0"],
    [*_DEMO, "--batch", "-1"],
    [*_DEMO, "--every", "0"],
    [*_DEMO, "--overhead", "0"],
    [*_DEMO, "--overhead", "1"],
    [*_DEMO, "--overhead", "nan"],
    [*_DEMO, "--overhead", "two"],
    [*_DEMO, "--every", "2", "--overhead", "0.05"],  # exclusive: a fixed interval or a budget
    [*_DEMO, "--port", "-1"],
    [*_DEMO, "--port", "65536"],
    [*_DEMO, "--port", "http"],
    [*_DEMO, "--linger", "nan"],
    [*_DEMO, "--linger", "inf"],
    [*_DEMO, "--linger", "-inf"],
    [*_DEMO, "--linger", "-1"],
    [*_DEMO, "--linger", "1e400"],
    [*_DEMO, "--linger", "soon"],
    ["report", "run.jsonl", "--top", "0"],
    ["report", "run.jsonl", "--top", "-2"],
    ["replay", "run.jsonl", "--port", "70000"],
    ["replay", "run.jsonl", "--port", "-1"],
    ["replay", "run.jsonl", "--speed", "-1"],
    ["replay", "run.jsonl", "--speed", "nan"],
    ["replay", "run.jsonl", "--speed", "inf"],
    ["replay", "run.jsonl", "--speed", "fast"],
    ["report"],  # the run argument is missing
    ["plot", "run.jsonl", "--output"],  # the option's value is missing
    ["report", "run.jsonl", "--bogus"],
]


@pytest.mark.parametrize("argv", BAD_OPTIONS, ids=" ".join)
def test_bad_option_values_are_one_line_and_status_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # whatever happens, nothing is written outside tmp_path
    code, _, err = _cli(argv, capsys)
    line = _assert_one_error_line(code, err, None)
    assert "--help" in line  # where to look next
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("argv", [[], ["train"]], ids=["no command", "unknown command"])
def test_a_missing_or_unknown_command_is_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _cli(argv, capsys)
    assert code == 2
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("streamwatch: error: ")


def test_good_option_values_still_parse() -> None:
    from streamwatch.cli import build_parser

    args = build_parser().parse_args(["demo", "--linger", "0", "--port", "65535", "--log-every", "1"])
    assert (args.linger, args.port, args.log_every) == (0.0, 65535, 1)
    args = build_parser().parse_args(["replay", "r", "--speed", "0", "--port", "0"])
    assert (args.speed, args.port) == (0.0, 0)


# --- 2. and the rest: run files and paths that are not what they should be ----------------------------


def _missing(tmp: Path) -> Path:
    return tmp / "nowhere"


def _dir_without_run_file(tmp: Path) -> Path:
    (tmp / "d").mkdir()
    return tmp / "d"


def _run_file_is_a_directory(tmp: Path) -> Path:
    (tmp / "d" / "run.jsonl").mkdir(parents=True)
    return tmp / "d"


def _empty_file(tmp: Path) -> Path:
    (tmp / "run.jsonl").touch()
    return tmp / "run.jsonl"


def _text_file(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("hello\nworld\n")
    return tmp / "notes.txt"


def _binary_file(tmp: Path) -> Path:
    (tmp / "blob").write_bytes(b"\xff\xfe\x00\x01" * 64 + b"\n")
    return tmp / "blob"


def _other_json(tmp: Path) -> Path:
    (tmp / "run.jsonl").write_text('{"format": "something-else", "version": 1}\n{"step": 0}\n')
    return tmp / "run.jsonl"


def _deep_header(tmp: Path) -> Path:
    (tmp / "run.jsonl").write_text(DEEP + "\n")
    return tmp / "run.jsonl"


def _deep_line(tmp: Path) -> Path:
    (tmp / "run.jsonl").write_text(f"{HEADER}\n{DEEP}\n{{}}\n")
    return tmp / "run.jsonl"


def _deep_last_line(tmp: Path) -> Path:
    (tmp / "run.jsonl").write_text(f"{HEADER}\n{DEEP}\n")
    return tmp / "run.jsonl"


def _corrupt_middle_line(tmp: Path) -> Path:
    path = _write_run(tmp / "run.jsonl", 3)
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = '{"step": 0, "rows": "oops"}\n'
    path.write_text("".join(lines))
    return path


def _not_a_regular_file(tmp: Path) -> Path:
    return Path(os.devnull)


BAD_RUNS: list[Callable[[Path], Path]] = [
    _missing,
    _dir_without_run_file,
    _run_file_is_a_directory,
    _empty_file,
    _text_file,
    _binary_file,
    _other_json,
    _deep_header,
    _deep_line,
    _corrupt_middle_line,
    _not_a_regular_file,
]

COMMANDS = [
    ["report"],
    pytest.param(
        ["plot", "-o", "out.png"],
        marks=pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="plot needs matplotlib (the demo extra)"),
    ),
    ["replay", "--port", "0", "--speed", "0"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("make", BAD_RUNS, ids=lambda f: f.__name__.strip("_"))
def test_a_bad_run_file_is_one_line_and_status_2(
    command: list[str],
    make: Callable[[Path], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    run = make(tmp_path)
    code, out, err = _cli([command[0], str(run), *command[1:]], capsys)
    _assert_one_error_line(code, err, command[0])
    assert not (tmp_path / "out.png").exists()
    assert "replaying" not in out  # replay refused before serving anything


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c[0])
def test_a_deeply_nested_last_line_is_no_traceback(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last line may be a record cut short by a crash: read_run may report it as truncated (the
    command then runs on the steps before it) or refuse the file; either way, no traceback."""
    monkeypatch.chdir(tmp_path)
    run = _deep_last_line(tmp_path)
    if command[0] == "replay":  # read as truncated, it serves until stopped: a subprocess
        proc = _streamwatch(command[0], str(run), *command[1:], cwd=tmp_path)
        assert proc.stdout is not None
        serving = "replaying" in proc.stdout.readline()
        if serving:
            proc.terminate()
        _, err = proc.communicate(timeout=60)
        assert "Traceback" not in err, err
        if not serving:
            _assert_one_error_line(proc.returncode, err, command[0])
        return
    code, _, err = _cli([command[0], str(run), *command[1:]], capsys)
    assert "Traceback" not in err
    if code != 0:
        _assert_one_error_line(code, err, command[0])


def test_deeply_nested_run_file_from_a_real_process(tmp_path: Path) -> None:
    """The reported crash, exactly: ``report`` on a run file with a line nested 100 000 deep."""
    run = _deep_line(tmp_path)
    proc = _streamwatch("report", str(run), cwd=tmp_path)
    _, err = proc.communicate(timeout=100)
    _assert_one_error_line(proc.returncode, err, "report")
    assert "RecursionError" not in err


def test_a_reader_that_goes_away_ends_report_quietly(tmp_path: Path) -> None:
    """``streamwatch report run | head``: once the reader has closed the pipe, report stops as cat does
    (the SIGPIPE status, 141), with nothing on stderr: no traceback, no error line."""
    run = _write_run(tmp_path / "run.jsonl", 3)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    with os.fdopen(write, "w") as stdout:
        proc = subprocess.run(
            [sys.executable, "-m", "streamwatch", "report", str(run)],
            cwd=tmp_path,
            env=_env(),
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=100,
            check=False,
        )
    assert proc.returncode == 141
    assert proc.stderr == ""


@pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="plot needs matplotlib (the demo extra)")
@pytest.mark.parametrize(
    "output",
    [
        lambda tmp: tmp / "no" / "such" / "dir" / "run.png",  # the directory is missing
        lambda tmp: tmp,  # a directory, not a file
        lambda tmp: _text_file(tmp) / "run.png",  # under a file
    ],
    ids=["missing directory", "a directory", "under a file"],
)
def test_plot_to_an_unwritable_output_is_one_line(
    output: Callable[[Path], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write_run(tmp_path / "run" / "run.jsonl", 3)
    code, out, err = _cli(["plot", str(run), "-o", str(output(tmp_path))], capsys)
    _assert_one_error_line(code, err, "plot")
    assert "wrote" not in out


def test_demo_run_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    taken = _text_file(tmp_path)
    code, _, err = _cli([*_DEMO, "--run-dir", str(taken)], capsys)
    _assert_one_error_line(code, err, "demo")
    assert taken.read_text() == "hello\nworld\n"


def test_demo_run_dir_with_a_foreign_run_file_is_one_line_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "run.jsonl").write_text("not a run file\n")
    code, _, err = _cli([*_DEMO, "--run-dir", str(run_dir)], capsys)
    _assert_one_error_line(code, err, "demo")
    assert (run_dir / "run.jsonl").read_text() == "not a run file\n"


def test_demo_whose_run_file_fails_mid_run_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run file on a full disk (``/dev/full``): the sink's pipeline fails on the worker and close()
    raises its PipelineError, which ended the demo in a traceback."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "run.jsonl").symlink_to("/dev/full")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        code, _, err = _cli([*_DEMO, "--steps", "5", "--every", "1", "--run-dir", str(run_dir)], capsys)
    line = _assert_one_error_line(code, err, "demo")
    assert "training ran, but 1 pipeline failed" in line
    assert "No space left on device" in line
    assert not [w for w in seen if "streamwatch" in str(w.message)]  # said once: by that line


def test_demo_whose_run_file_fails_mid_run_prints_one_line_from_a_real_process(tmp_path: Path) -> None:
    """The same as a user sees it: the failure's warning at the next step (three lines, with its source
    line) came before the error line."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "run.jsonl").symlink_to("/dev/full")
    demo = _streamwatch(*_DEMO, "--steps", "5", "--every", "1", "--run-dir", str(run_dir), cwd=tmp_path)
    _, err = demo.communicate(timeout=120)
    assert demo.returncode == 2, err
    assert err.splitlines() == [err.strip()], err
    assert err.startswith("streamwatch demo: error: training ran, but 1 pipeline failed"), err


def test_a_second_demo_in_one_run_dir_numbers_its_steps_after_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both demos append to one run file: the second's steps restarted at 0, so report printed the last
    session's range only and plot drew lines running backwards."""
    run_dir = tmp_path / "r"
    for _ in range(2):
        code, _, err = _cli([*_DEMO, "--every", "1", "--run-dir", str(run_dir)], capsys)
        assert code == 0, err
    assert [r.step for r in read_run(run_dir / "run.jsonl").records] == [0, 1, 2, 3]


def test_demo_model_too_large_to_build_is_one_line_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "r"
    code, _, err = _cli([*_DEMO, "--hidden", str(10**12), "--run-dir", str(run_dir)], capsys)
    line = _assert_one_error_line(code, err, "demo")
    assert "--hidden" in line
    assert not run_dir.exists()


def test_replay_on_a_taken_port_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run" / "run.jsonl", 2)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, out, err = _cli(["replay", str(run), "--port", str(port)], capsys)
    line = _assert_one_error_line(code, err, "replay")
    assert f"port {port} on 127.0.0.1 is already in use" in line
    assert "--port" in line
    assert "replaying" not in out


# --- 4. a demo that cannot serve leaves no run directory -------------------------------------------


@pytest.mark.timeout(200)
def test_demo_on_a_taken_port_is_one_line_and_leaves_no_run_directory(tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b" / "c"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        explicit = _streamwatch(
            "demo", "--no-live", "--steps", "5", "--port", port, "--run-dir", str(nested), cwd=tmp_path
        )
        _, err = explicit.communicate(timeout=100)
        line = _assert_one_error_line(explicit.returncode, err, "demo")
        assert f"port {port} on 127.0.0.1 is already in use" in line
        assert not (tmp_path / "a").exists(), list(tmp_path.rglob("*"))
        default = _streamwatch("demo", "--steps", "5", "--port", port, cwd=tmp_path)  # runs/<time>, live view
        _, err = default.communicate(timeout=100)
    _assert_one_error_line(default.returncode, err, "demo")
    assert not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))


def test_demo_on_a_taken_port_keeps_an_existing_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    previous = _write_run(run_dir / "run.jsonl", 2)
    before = previous.read_bytes()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        proc = _streamwatch(
            "demo", "--no-live", "--steps", "5", "--port", port, "--run-dir", str(run_dir), cwd=tmp_path
        )
        _, err = proc.communicate(timeout=100)
    _assert_one_error_line(proc.returncode, err, "demo")
    assert previous.read_bytes() == before  # an earlier run in the same directory is untouched


# --- 3. replay never spins a core ---------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """utime + stime of the whole process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("steps", "options"),
    [
        (5, ["--loop", "--speed", "0"]),
        (5, ["--loop", "--speed", "1e9"]),
        (0, ["--loop"]),
        (0, ["--loop", "--speed", "0"]),
        (0, []),
    ],
    ids=[
        "loop at speed 0",
        "loop at speed 1e9",
        "header-only loop",
        "header-only loop speed 0",
        "header-only",
    ],
)
def test_replay_sleeps_instead_of_spinning(steps: int, options: list[str], tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run" / "run.jsonl", steps)
    proc = _streamwatch("replay", str(run), "--port", "0", *options, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # printed once serving (startup CPU is not counted)
        assert "replaying" in line, line + (proc.stderr.read() if proc.stderr else "")
        time.sleep(0.5)  # let it settle into its steady state
        before, start = _cpu_seconds(proc.pid), time.monotonic()
        time.sleep(2.0)
        used, wall = _cpu_seconds(proc.pid) - before, time.monotonic() - start
        assert proc.poll() is None, "replay ended on its own"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert used < 0.5, f"{used:.2f} s of CPU in {wall:.2f} s of wall time: a busy loop"
    assert "Traceback" not in err, err
    if steps == 0:
        assert "no steps" in err


def test_replay_on_an_address_not_of_this_machine_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _write_run(tmp_path / "run" / "run.jsonl", 2)
    code, out, err = _cli(["replay", str(run), "--port", "0", "--host", "192.0.2.1"], capsys)  # TEST-NET-1
    line = _assert_one_error_line(code, err, "replay")
    assert "cannot serve /metrics on 192.0.2.1" in line
    assert "replaying" not in out


def test_demos_started_in_the_same_second_get_their_own_run_directories(tmp_path: Path) -> None:
    from streamwatch.cli import _new_run_dir

    first, created = _new_run_dir(tmp_path / "runs", "20240101-000000")
    second, _ = _new_run_dir(tmp_path / "runs", "20240101-000000")
    assert created == [tmp_path / "runs", first]
    assert (first.name, second.name) == ("20240101-000000", "20240101-000000-2")
