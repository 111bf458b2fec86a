"""The run file sink: real training written to JSON Lines and read back exactly, crashes, appends, reports."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import streamwatch as sw
from streamwatch import StepRecord, testing
from streamwatch._report import report
from streamwatch._summary import COLUMNS, derive
from streamwatch.sinks import RunData, RunFile, RunFileError, read_run
from streamwatch.sinks._runformat import FORMAT, VERSION

NAN_STEP = 3
STEPS = 7


def make_model(seed: int = 0, width: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.Tanh(),
        torch.nn.Linear(width, 4),
    )
    with torch.no_grad():  # a quarter of the ReLU's units dead: a dead fraction to rank
        model[0].bias[: width // 4] = -100.0
    return model


def train(
    path: Path,
    *,
    steps: int = STEPS,
    nan_step: int | None = NAN_STEP,
    seed: int = 0,
    width: int = 16,
    fsync: bool = False,
    nested: bool = False,
) -> list[StepRecord]:
    """Train for ``steps`` steps writing to ``path``; returns the records every sink received.

    ``nested`` wraps the model in another Sequential: its layers are named ``0.0``, ``0.2``, …"""
    model = make_model(seed, width)
    if nested:
        model = torch.nn.Sequential(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reference = sw.sinks.collect()
    generator = torch.Generator().manual_seed(seed)
    with sw.observe(
        model,
        opt,
        sinks=[RunFile(path, fsync=fsync), reference],
        overflow="block",
        metrics=[*sw.DEFAULT_METRICS, sw.metrics.SpectralNorm()],
        every=1,
    ) as watch:
        for step in range(steps):
            x = torch.randn(16, 8, generator=generator)
            y = torch.randint(0, 4, (16,), generator=generator)
            if step == nan_step:
                x[0, 0] = math.nan
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(loss):  # skip the update on a non-finite loss (as a grad scaler would)
                opt.step()
            watch.step(loss=loss, outputs=logits, targets=y, batch_size=16)
    assert reference.closed
    assert reference.error is None
    return reference.items


def assert_same_table(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype == np.float64
    assert a.shape == b.shape
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    assert np.array_equal(nan_a, nan_b)
    assert a[~nan_a].tobytes() == b[~nan_b].tobytes()  # bit-exact, -0.0 included


def assert_same_records(got: list[StepRecord], expected: list[StepRecord]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert (g.step, g.time, g.rank) == (e.step, e.time, e.rank)
        assert g.keys == e.keys
        assert_same_table(g.table, e.table)
        assert g.scalars.keys() == e.scalars.keys()
        for name, value in e.scalars.items():
            assert np.float64(g.scalars[name]).tobytes() == np.float64(value).tobytes(), name
        assert g.extras.keys() == e.extras.keys()
        for extra, vector in e.extras.items():
            assert_same_table(np.asarray(g.extras[extra]), np.asarray(vector, dtype=np.float64))


def step_lines(path: Path) -> list[tuple[int, int]]:
    """(start offset, end offset) of every complete step line (newline included)."""
    data = path.read_bytes()
    spans, start = [], 0
    for line in data.splitlines(keepends=True):
        if line.startswith(b'{"step"') and line.endswith(b"\n"):
            spans.append((start, start + len(line)))
        start += len(line)
    return spans


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[StepRecord]]:
    path = tmp_path_factory.mktemp("run") / "run.jsonl"
    return path, train(path)


# -- round trip ---------------------------------------------------------------------------------------------


def test_a_real_training_reads_back_exactly(trained: tuple[Path, list[StepRecord]]) -> None:
    path, reference = trained
    run = read_run(path)
    assert len(reference) == STEPS
    assert_same_records(run.records, reference)
    assert run.last_good_step == STEPS - 1
    assert not run.truncated
    assert run.problems == []
    assert run.header["format"] == FORMAT
    assert run.header["version"] == VERSION
    assert run.header["columns"] == list(COLUMNS)
    # what the test relies on really happened: NaN rows, a NaN loss, spectral-norm extras
    nan_record = reference[NAN_STEP]
    assert np.isnan(nan_record.table).any()
    assert math.isnan(nan_record.scalars["loss"])
    assert any(stat == "spectral_norm" for _, stat in reference[-1].extras)
    assert all(not r.table.flags.writeable for r in run.records)


def test_the_format_is_compact_json_lines(trained: tuple[Path, list[StepRecord]]) -> None:
    path, reference = trained
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    lines = [json.loads(line) for line in text.splitlines()]  # every line is standard JSON
    assert "NaN" not in text
    assert '"nan"' in text
    header, rest = lines[0], lines[1:]
    assert set(header) == {"format", "version", "columns", "created"}
    assert [line["step"] for line in rest if "step" in line] == [r.step for r in reference]
    ids = [entry[0] for line in rest if "keys" in line for entry in line["keys"]]
    assert ids == list(range(len(ids)))  # each key written once, small consecutive ids
    all_keys = {k for r in reference for k in r.keys} | {k for r in reference for k, _ in r.extras}
    assert len(ids) == len(all_keys)
    # a key line comes right before the first step that uses its keys
    assert "keys" in lines[1]
    assert "step" in lines[2]
    assert ", " not in text  # compact separators


def test_a_closed_sink_without_steps_leaves_a_header(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    sink = RunFile(path)
    sink.close()
    sink.close()
    run = read_run(path)
    assert run.records == []
    assert run.last_good_step is None
    assert not run.truncated
    with pytest.raises(RuntimeError, match="closed"):
        sink.send(StepRecord(0, 0.0, 0, (), testing.table(0)))


def test_one_file_has_one_writer_in_a_process(tmp_path: Path) -> None:
    # two watches (a GAN's generator and discriminator, say) with a RunFile each on one path: each
    # numbers its series itself, so the second to add a series reused an id and the file did not read
    path = tmp_path / "run.jsonl"
    key = sw.SeriesKey("train", "g", "param", "w")
    first = RunFile(path)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(RunFileError, match=r"another RunFile of this process.*its own file"):
        RunFile(tmp_path / "link" / "run.jsonl")  # (the same file, by another path)
    first.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=0.0)))
    first.close()
    second = RunFile(path)  # the first is closed: the file is the second's to continue
    other = key._replace(layer="d")
    second.send(StepRecord(1, 1.0, 0, (other, key), testing.table(2, fill=1.0)))
    RunFile(tmp_path / "elsewhere.jsonl")  # never closed, and dropped: a gone sink writes no more
    second.close()
    RunFile(tmp_path / "elsewhere.jsonl").close()
    run = read_run(path)
    assert [(r.step, r.keys) for r in run.records] == [(0, (key,)), (1, (other, key))]


_OTHER_WRITER = textwrap.dedent(
    """
    import sys, streamwatch as sw
    from streamwatch import testing
    from streamwatch.sinks import RunFile
    sink = RunFile(sys.argv[1])
    key = sw.SeriesKey("train", "other", "param", "w")
    sink.send(sw.StepRecord(0, 0.0, 1, (key,), testing.table(1, fill=0.0)))
    print("writing", flush=True)
    sys.stdin.readline()  # held open (and locked) until told
    sink.send(sw.StepRecord(1, 1.0, 1, (key,), testing.table(1, fill=1.0)))
    sink.close()
    """
)


def test_one_file_has_one_writer_across_processes(tmp_path: Path) -> None:
    # two ranks given the same path: each numbers its series itself, so the file read back with series
    # swapped or failed to read; the second writer is now refused while the first appends
    path = tmp_path / "run.jsonl"
    late = RunFile(path)  # made before the other process starts: it finds out at its first step
    with subprocess.Popen(
        [sys.executable, "-c", _OTHER_WRITER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as other:
        try:
            assert other.stdout is not None
            assert other.stdin is not None
            assert other.stdout.readline() == "writing\n"
            key = sw.SeriesKey("train", "mine", "param", "w")
            with pytest.raises(RunFileError, match=r"another process.*its own file") as refused:
                late.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=7.0)))
            late.fail(refused.value)  # (what its pipeline does)
            with pytest.raises(RunFileError, match=r"another process.*its own file"):
                RunFile(path)
            other.stdin.write("go\n")
            other.stdin.flush()
            assert other.wait(60) == 0
        finally:
            other.kill()
    run = read_run(path)  # the other process's two steps, nothing of the refused writer's
    assert [(r.step, r.rank, r.keys[0].layer) for r in run.records] == [(0, 1, "other"), (1, 1, "other")]
    assert not run.truncated
    after = RunFile(path)  # the other process closed it: continued as before
    after.send(StepRecord(2, 2.0, 0, (key,), testing.table(1, fill=1.0)))
    after.close()
    assert [r.step for r in read_run(path).records] == [0, 1, 2]


def test_the_lock_stands_against_a_hard_link_and_through_reading_in_the_writing_process(
    tmp_path: Path,
) -> None:
    """The lock is the open file's: a second writer in this process through a hard link (another path)
    is refused, and this process reading the file (read_run, report) does not release it for others."""
    path = tmp_path / "run.jsonl"
    key = sw.SeriesKey("train", "a", "param", "w")
    writer = RunFile(path)
    writer.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=0.0)))
    os.link(path, tmp_path / "alias.jsonl")
    with pytest.raises(RunFileError, match="being written"):
        RunFile(tmp_path / "alias.jsonl")
    assert [r.step for r in read_run(path).records] == [0]
    report(read_run(path))
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from streamwatch.sinks import RunFile; RunFile(sys.argv[1])",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert other.returncode != 0
    assert "being written by another process" in other.stderr
    writer.send(StepRecord(1, 1.0, 0, (key,), testing.table(1, fill=1.0)))
    writer.close()
    assert [r.step for r in read_run(path).records] == [0, 1]


def _wait_in_child(started: Any, release: Any) -> None:
    started.set()
    release.wait(60)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_does_not_keep_the_lock(tmp_path: Path) -> None:
    """A child forked while the file is open (a DataLoader's workers) shares the open file and its lock:
    the lock outlived the parent's close(), and the parent itself could not reopen its file."""
    import multiprocessing

    path = tmp_path / "run.jsonl"
    key = sw.SeriesKey("train", "a", "param", "w")
    first = RunFile(path)
    first.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=0.0)))
    context = multiprocessing.get_context("fork")
    started, release = context.Event(), context.Event()
    child = context.Process(target=_wait_in_child, args=(started, release))  # alive while the parent goes on
    child.start()
    try:
        assert started.wait(60)  # (the child runs from here: its copy of the file is closed)
        first.close()
        second = RunFile(path)  # refused before: "being written by another process"
        second.send(StepRecord(1, 1.0, 0, (key,), testing.table(1, fill=1.0)))
        second.close()
    finally:
        release.set()
        child.join(60)
    assert child.exitcode == 0
    assert [r.step for r in read_run(path).records] == [0, 1]


@contextlib.contextmanager
def _a_child_forked_in(monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[None]:
    """Within: the first call of the run-file writer's function ``name`` forks a child first (as a
    ``DataLoader`` starting its workers would), which lives on until the end of the block; every child
    must then exit cleanly."""
    import multiprocessing

    import streamwatch.sinks._runwriter as runwriter

    context = multiprocessing.get_context("fork")
    started, release = context.Event(), context.Event()
    children: list[Any] = []
    real = getattr(runwriter, name)

    def forking(*args: Any, **kwargs: Any) -> Any:
        if not children:
            child = context.Process(target=_wait_in_child, args=(started, release))
            child.start()
            children.append(child)
            assert started.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(runwriter, name, forking)
    try:
        yield
    finally:
        release.set()
        for child in children:
            child.join(60)
    assert [c.exitcode for c in children] == [0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_while_the_lock_is_taken_does_not_keep_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first write opens the file, then locks it: a fork in between (DataLoader workers starting
    while the worker thread writes the first record) left the child a descriptor the fork handler did
    not know of yet, and the lock outlived the parent's close()."""
    path = tmp_path / "run.jsonl"
    key = sw.SeriesKey("train", "a", "param", "w")
    with _a_child_forked_in(monkeypatch, "_lock"):  # the fork lands between open() and flock
        first = RunFile(path)
        first.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=0.0)))
        first.close()
        second = RunFile(path)  # refused before: "being written by another process"
        second.send(StepRecord(1, 1.0, 0, (key,), testing.table(1, fill=1.0)))
        second.close()
    assert [r.step for r in read_run(path).records] == [0, 1]


def test_a_resumed_runs_first_step_is_certain_in_the_report_as_it_was_live(tmp_path: Path) -> None:
    """``observe(start_step=100)``: a NaN in the first step is certain live (nothing unrecorded came
    before it); the report, recomputing from the file, said "uncertain" while the file did not hold
    the run's first step."""
    path = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with sw.observe(model, every=1, start_step=100, sinks=[RunFile(path)]) as watch:
        for i in range(3):
            x = torch.randn(5, 4)
            if i == 0:
                x[0, 0] = math.nan
            model(x).sum().backward()
            watch.step()
        assert watch.flush()
        live = watch.statistics().first_nonfinite
    assert live is not None
    assert (live.step, live.certain) == (100, True)
    records = read_run(path).records
    assert [(r.step, r.start_step) for r in records] == [(100, 100), (101, 100), (102, 100)]
    text = report(read_run(path))
    assert "first non-finite: step 100, rank 0, layer '0', kind activation" in text
    assert "uncertain" not in text
    assert '"start":100' in path.read_text().splitlines()[-1]


def test_the_reports_dead_units_and_gradients_are_the_trainings_not_an_evaluations(tmp_path: Path) -> None:
    """An evaluation after the last step is sent at close as a record of its own: the report took its
    activation rows (any phase) as the layers' dead fractions."""
    path = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
    with sw.observe(model, every=1, sinks=[RunFile(path)]) as watch:
        for _ in range(2):
            model(torch.randn(16, 4)).sum().backward()
            watch.step()
        with torch.no_grad():
            model[0].bias.fill_(-100.0)  # every unit dead in the evaluation only
            model.eval()
            model(torch.randn(16, 4))
    records = read_run(path).records
    assert {k.phase for k in records[-1].keys} == {"eval"}
    train = next(r for r in reversed(records) if r.rows("activation", "train"))
    fraction = derive(train.table)["dead_fraction"]
    expected = {train.keys[i].layer: float(fraction[i]) for i in train.rows("activation", "train")}
    assert expected["1"] < 1.0
    text = report(read_run(path))
    assert f"worst layers by dead fraction (activation, step {train.step}):" in text
    assert "100.00%" not in text


@pytest.mark.parametrize("keep", [1, 6, 30, -1], ids=["1", "6", "30", "all-but-newline"])
def test_a_header_cut_short_is_a_truncated_empty_run_that_a_writer_starts_again(
    tmp_path: Path, keep: int
) -> None:
    """A disk that fills during the first write leaves part of the header: it read as "not a
    streamwatch run file", and the run could not be continued."""
    path = tmp_path / "run.jsonl"
    RunFile(path).close()
    whole = path.read_bytes()
    path.write_bytes(whole[:keep])
    run = read_run(path)
    assert (run.truncated, run.records, run.last_good_step) == (True, [], None)
    assert any("header line was cut short" in problem for problem in run.problems)
    assert "truncated: yes (no complete step)" in report(run)
    key = sw.SeriesKey("train", "a", "param", "w")
    sink = RunFile(path)
    sink.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=1.0)))
    sink.close()
    again = read_run(path)
    assert (again.truncated, [r.step for r in again.records]) == (False, [0])
    assert again.header["format"] == FORMAT


def test_a_line_that_is_no_header_is_still_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(b'{"format":"other"')
    with pytest.raises(RunFileError, match="line 1: not a streamwatch run file"):
        read_run(path)
    with pytest.raises(RunFileError, match="not a streamwatch run file"):
        RunFile(path)


def test_report_names_the_first_value_of_a_resumed_session_in_its_own_record(tmp_path: Path) -> None:
    """Two sessions in one file, the second resumed from an older checkpoint (its steps repeat the
    first's): the report's "(+N more rows)" was counted in the first session's finite record of that
    step number, and the certainty judged on the first session's records."""
    path = tmp_path / "run.jsonl"
    keys = tuple(sw.SeriesKey("train", f"l{i}", "activation", "") for i in range(3))
    finite = testing.table(3, count=4, fill=0.0)
    bad = testing.table(3, count=4, nonfinite=1, fill=0.0)  # every row non-finite
    sink = RunFile(path)
    for step in range(8):  # session 1: steps 0..7, every one in full
        sink.send(StepRecord(step, 0.0, 0, keys, finite))
    sink.send(StepRecord(6, 1.0, 0, keys, bad, start_step=4))  # session 2 from step 4: 4, 5 unrecorded
    sink.close()
    text = report(read_run(path))
    line = next(line for line in text.splitlines() if line.startswith("first non-finite"))
    assert line.startswith("first non-finite: step 6, rank 0, layer 'l0', kind activation, name '', ")
    assert line.endswith(
        "direction forward (+2 more rows); uncertain: the step before was not recorded in full"
    )


def test_a_pipe_is_refused_as_a_run_file(tmp_path: Path) -> None:
    """A FIFO: opening it for writing waits for a reader (holding up every fork of the process meanwhile),
    and a run file is read back and appended to, which a pipe cannot be."""
    path = tmp_path / "run.jsonl"
    os.mkfifo(path)
    with pytest.raises(RunFileError, match="is a pipe"):
        RunFile(path)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_while_an_existing_file_is_scanned_does_not_keep_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Appending to an existing (large) file scans it under a shared lock: a child forked meanwhile kept
    that lock, and the parent's first record was refused as "being written by another process"."""
    path = tmp_path / "run.jsonl"
    key = sw.SeriesKey("train", "a", "param", "w")
    first = RunFile(path)
    first.send(StepRecord(0, 0.0, 0, (key,), testing.table(1, fill=0.0)))
    first.close()
    with _a_child_forked_in(monkeypatch, "_scan_for_append"):
        second = RunFile(path)
        second.send(StepRecord(1, 1.0, 0, (key,), testing.table(1, fill=1.0)))
        second.close()
    assert [r.step for r in read_run(path).records] == [0, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_fork_while_this_thread_opens_a_run_file_does_not_deadlock() -> None:
    """A fork from a signal handler that interrupted this thread's open() of a run file: the fork
    handler takes the lock the open holds, which must be reentrant."""
    script = textwrap.dedent(
        """
        import os
        import streamwatch.sinks._runwriter as runwriter
        with runwriter._OPENING:  # as inside RunFile._open, when a signal handler forks
            pid = os.fork()
            if pid == 0:
                os._exit(0)
        os.waitpid(pid, 0)
        print("forked")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "forked"


def test_special_floats_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "floats.jsonl"
    values = [0.0, -0.0, 1.0, -3.0, 0.1, 1e-310, 2.0**53, 2.0**60, -math.inf, math.inf, math.nan, 1 / 3]
    key = sw.SeriesKey("train", "λ.layer", "param", "w")
    table = np.resize(np.array(values, dtype=np.float64), (2, len(COLUMNS)))  # every column, every value
    keys = (key, key._replace(kind="param_grad"))
    record = StepRecord(
        5, 1.25, 2, keys, table, {"loss": math.inf, "x": -0.0}, {(key, "h"): np.array(values)}
    )
    sink = RunFile(path, fsync=True)
    sink.send(record)
    sink.fail(RuntimeError("boom"))
    assert_same_records(read_run(path).records, [record])


def test_fsync_training(tmp_path: Path) -> None:
    path = tmp_path / "fsync.jsonl"
    reference = train(path, steps=2, nan_step=None, fsync=True)
    assert_same_records(read_run(path).records, reference)


def test_send_rejects_other_items(tmp_path: Path) -> None:
    sink = RunFile(tmp_path / "r.jsonl")
    with pytest.raises(TypeError, match="StepRecord"):
        sink.send({"step": 1})
    sink.close()


# -- truncation and corruption -----------------------------------------------------------------------------


def test_a_cut_at_any_offset_reads_every_complete_step(
    trained: tuple[Path, list[StepRecord]], tmp_path: Path
) -> None:
    path, reference = trained
    data = path.read_bytes()
    spans = step_lines(path)
    last_start, last_end = spans[-1]
    header_end = data.index(b"\n") + 1
    cuts = {last_start + 1, (last_start + last_end) // 2, last_end - 1, last_end - 2}
    cuts |= set(np.linspace(header_end + 1, len(data) - 1, 25).astype(int).tolist())
    cuts |= {end for _, end in spans[:-1]}  # exactly at line ends: nothing truncated
    for cut in sorted(cuts):
        cut_path = tmp_path / f"cut{cut}.jsonl"
        cut_path.write_bytes(data[:cut])
        run = read_run(cut_path)
        complete = sum(end <= cut for _, end in spans)
        assert_same_records(run.records, reference[:complete])
        expected_last = reference[complete - 1].step if complete else None
        assert run.last_good_step == expected_last, cut
        at_boundary = data[cut - 1 : cut] == b"\n"
        assert run.truncated is not at_boundary, cut
        if run.truncated:
            assert len(run.problems) == 1
            assert "truncated" in run.problems[0]
            assert f"last good step: {expected_last}" in run.problems[0]
            assert "truncated: yes" in report(run)


def test_a_last_line_that_does_not_parse_is_truncated(
    trained: tuple[Path, list[StepRecord]], tmp_path: Path
) -> None:
    path, reference = trained
    broken = tmp_path / "zeros.jsonl"
    broken.write_bytes(path.read_bytes() + b"\x00\x00\x00\x00\n")  # e.g. a power loss's zero fill
    run = read_run(broken)
    assert run.truncated
    assert_same_records(run.records, reference)


def test_a_corrupt_middle_line_names_the_line(trained: tuple[Path, list[StepRecord]], tmp_path: Path) -> None:
    path, _ = trained
    lines = path.read_bytes().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith(b'{"step":2,'))
    previous_step = json.loads(lines[index - 1])["step"] if b'"step"' in lines[index - 1] else None
    for garbage in (
        b'{"step": 2, "rows": [[0, 1\n',
        b'{"step":2,"time":0,"rank":0,"rows":[[9999]]}\n',
        b"\n",
    ):
        bad = tmp_path / "bad.jsonl"
        bad.write_bytes(b"".join([*lines[:index], garbage, *lines[index + 1 :]]))
        with pytest.raises(RunFileError, match=f"line {index + 1}:") as info:
            read_run(bad)
        assert str(bad) in str(info.value)
        assert f"last good step: {previous_step}" in str(info.value)
    bad.write_bytes(
        b"".join(
            [
                *lines[:index],
                b'{"step":2,"time":0,"rank":0,"rows":[],"scalars":{"loss":"NaN"}}\n',
                *lines[index + 1 :],
            ]
        )
    )
    with pytest.raises(RunFileError, match="nan"):
        read_run(bad)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"hello world\n", "not a streamwatch run file"),
        (b'{"format": "other", "version": 1}\n', "header format 'other'"),
        (b'{"format": "streamwatch-run", "version": 2, "columns": []}\n', "unsupported run file version 2"),
        (b'{"step": 0, "time": 0, "rank": 0, "rows": [], "scalars": {}}\n', "header format None"),
        (
            b'{"format": "streamwatch-run", "version": 1, "columns": [], "edges": [1, 2]}\n',
            "'edges' must be an object of tap kind -> list of bounds",
        ),
        (
            b'{"format": "streamwatch-run", "version": 1, "columns": [], "edges": {"param": [1, "x"]}}\n',
            "expected a number or 'nan'/'inf'/'-inf', got 'x'",
        ),
    ],
)
def test_a_bad_header_is_an_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(RunFileError, match=re.escape(message)) as info:
        read_run(path)
    assert str(path) in str(info.value)
    if content:
        with pytest.raises(ValueError, match=re.escape(message)):
            RunFile(path)


def test_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no run directory or run file at"):
        read_run(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match=r"is a directory without a run file \(run.jsonl\)"):
        read_run(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(RunFileError, match="not a regular file"):
        read_run(fifo)


def test_a_run_directory_is_read_as_the_command_line_reads_it(tmp_path: Path) -> None:
    """``read_run(run_dir)`` reads the directory's run file, as ``streamwatch report run_dir`` does
    (before: a RunFileError, 'not a regular file'); a directory of one rank file per process names them."""
    model = torch.nn.Linear(3, 2)
    with sw.observe(model, every=1, sinks=[RunFile(tmp_path / "run.jsonl")]) as watch:
        model(torch.randn(4, 3)).sum().backward()
        watch.step(loss=0.5)
    run = read_run(tmp_path)
    assert run.path == tmp_path / "run.jsonl"
    assert [r.scalars["loss"] for r in run.records] == [0.5]
    ranks = tmp_path / "ddp"
    ranks.mkdir()
    (tmp_path / "run.jsonl").rename(ranks / "run-rank0.jsonl")
    assert read_run(ranks).path == ranks / "run-rank0.jsonl"
    (ranks / "run-rank1.jsonl").write_bytes((ranks / "run-rank0.jsonl").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"run files of 2 ranks \(run-rank0.jsonl, run-rank1.jsonl\)"):
        read_run(ranks)
    assert read_run(ranks / "run-rank1.jsonl").records[0].scalars["loss"] == 0.5


def test_other_columns_are_rearranged_with_a_problem(tmp_path: Path) -> None:
    path = tmp_path / "old.jsonl"
    columns = [c for c in COLUMNS if c != "active"][::-1]
    lines = [
        {"format": FORMAT, "version": VERSION, "columns": columns, "created": 0.0},
        {"keys": [[0, "train", "fc", "activation", ""]]},
        {"step": 0, "time": 0.0, "rank": 0, "rows": [[0, *range(len(columns))]], "scalars": {}, "extras": []},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = read_run(path)
    record = run.records[0]
    assert record.column("count")[0] == columns.index("count")
    assert math.isnan(record.column("active")[0])
    assert "differ" in run.problems[0]
    with pytest.raises(ValueError, match="columns"):
        RunFile(path)


def test_a_run_file_written_before_the_shape_statistics_reads_back_with_them_unknown(tmp_path: Path) -> None:
    """A file whose header has the eleven columns of the versions before Σ|x|, Σx³ and Σx⁴: every
    record reads back with its values, the new columns and what derives from them unknown (NaN, so
    never served), and the report and a replay's samples work from it."""
    path = tmp_path / "old.jsonl"
    old = ["count", "sum", "sumsq", "min", "max", "zeros", "nonfinite", "units", "dead", "samples", "active"]
    lines = [
        {"format": FORMAT, "version": VERSION, "columns": old, "created": 0.0},
        {"keys": [[0, "train", "fc", "param_grad", "weight"]]},
        {"step": 0, "time": 0.0, "rank": 0, "rows": [[0, 4, 2, 6, -1, 2, 1, 0, "nan", "nan", "nan", "nan"]],
         "scalars": {"loss": 0.5}, "extras": []},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = read_run(path)
    (record,) = run.records
    assert [float(record.column(name)[0]) for name in ("count", "sum", "sumsq", "min", "max")] == [
        4,
        2,
        6,
        -1,
        2,
    ]
    for name in ("sumabs", "sumcube", "sumfourth", "mean_abs", "skewness", "kurtosis", "excess_kurtosis"):
        assert math.isnan(record.stat(name)[0]), name
    assert record.stat("l2")[0] == pytest.approx(math.sqrt(6))
    assert "NaN where a column is missing" in run.problems[0]
    assert "first non-finite: none" in report(run)
    store = sw.SeriesStore(metrics=())
    store.send(record)
    served = {s.labels["stat"] for s in store.samples() if s.name == "streamwatch_tensor"}
    assert "sumsq" in served
    assert not served & {"sumabs", "kurtosis", "mean_abs"}  # unknown: absent, never a NaN sample


# -- appending ----------------------------------------------------------------------------------------------


def test_appending_a_second_run_continues_ids_and_steps(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    first = train(path, steps=3, nan_step=None)
    ids_before = {
        e[0] for line in path.read_text().splitlines() if '"keys"' in line for e in json.loads(line)["keys"]
    }
    # cut the last line short as a crash would: the next run drops it and continues
    data = path.read_bytes()
    path.write_bytes(data[: step_lines(path)[-1][1] - 5])
    second = train(path, steps=3, nan_step=None, seed=1, width=12, nested=True)
    run = read_run(path)
    assert not run.truncated
    assert_same_records(run.records, first[:2] + second)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert sum("format" in line for line in lines) == 1
    ids = [e[0] for line in lines if "keys" in line for e in line["keys"]]
    assert ids == list(range(len(ids)))  # continued, never reused
    assert len(ids) > len(ids_before)  # the second model's layers have other names: new ids after the old
    assert [r.step for r in run.records] == [0, 1, 0, 1, 2]


def test_appending_to_a_file_with_a_corrupt_middle_line_fails(
    trained: tuple[Path, list[StepRecord]], tmp_path: Path
) -> None:
    path, _ = trained
    lines = path.read_bytes().splitlines(keepends=True)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join([*lines[:3], b"{oops\n", *lines[4:]]))
    with pytest.raises(ValueError, match="line 4"):
        RunFile(bad)


FOREIGN_LINES = [
    b'{"step": 2, "rows": [[0, 1\n',  # does not parse
    b'{"step":2,"time":0,"rank":0,"rows":[[9999]]}\n',  # an unknown key id
    b'{"step":2,"time":0,"rank":0,"rows":[],"scalars":{"loss":"NaN"}}\n',  # not a run file's number
    b'{"hello": "world"}\n',  # another program's JSON object
    b"[1, 2, 3]\n",  # JSON, not an object
    b"\n",
]


@pytest.mark.parametrize("garbage", FOREIGN_LINES, ids=range(len(FOREIGN_LINES)))
def test_appending_validates_every_line_as_read_run_does(
    trained: tuple[Path, list[StepRecord]], tmp_path: Path, garbage: bytes
) -> None:
    path, _ = trained
    lines = path.read_bytes().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if line.startswith(b'{"step":2,'))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join([*lines[:index], garbage, *lines[index + 1 :]]))
    with pytest.raises(RunFileError, match=f"line {index + 1}:") as read:
        read_run(bad)
    before = bad.read_bytes()
    with pytest.raises(
        RunFileError, match=f"^cannot append to {re.escape(str(bad))}: line {index + 1}:"
    ) as info:
        train(bad, steps=1)
    assert str(read.value).split(": ", 2)[2] in str(info.value)  # the same finding as read_run's
    assert "write to a new file" in str(info.value)
    assert bad.read_bytes() == before  # refused: nothing appended, nothing cut off


def test_a_deeply_nested_line_is_a_run_file_error(
    trained: tuple[Path, list[StepRecord]], tmp_path: Path
) -> None:
    path, reference = trained
    lines = path.read_bytes().splitlines(keepends=True)
    deep = b"[" * 100_000 + b"\n"
    bad = tmp_path / "deep.jsonl"
    bad.write_bytes(b"".join([*lines[:3], deep, *lines[3:]]))
    with pytest.raises(RunFileError, match=r"line 4: .*nested too deeply") as info:
        read_run(bad)
    assert str(bad) in str(info.value)
    with pytest.raises(RunFileError, match=r"line 4: .*nested too deeply"):
        RunFile(bad)
    # as the last line: a step cut short, like any last line that does not parse
    last = tmp_path / "deep-last.jsonl"
    last.write_bytes(path.read_bytes() + deep)
    run = read_run(last)
    assert run.truncated
    assert_same_records(run.records, reference)
    assert "nested too deeply" in run.problems[0]


def test_a_number_too_large_for_a_float_is_a_run_file_error(
    trained: tuple[Path, list[StepRecord]], tmp_path: Path
) -> None:
    path, _ = trained
    lines = path.read_bytes().splitlines(keepends=True)
    huge = b'{"step":2,"time":0,"rank":0,"rows":[],"scalars":{"loss":1' + b"0" * 400 + b"}}\n"
    bad = tmp_path / "huge.jsonl"
    bad.write_bytes(b"".join([*lines[:3], huge, *lines[3:]]))
    with pytest.raises(RunFileError, match=r"line 4: .*too large"):
        read_run(bad)


# -- bad paths ----------------------------------------------------------------------------------------------


@pytest.fixture
def frozen(tmp_path: Path) -> Iterator[Path]:
    """A directory in which even root cannot create or change anything (``chattr +i``)."""
    folder = tmp_path / "frozen"
    folder.mkdir()
    RunFile(folder / "old.jsonl").close()  # a valid run file, frozen too
    frozen_files = [folder / "old.jsonl", folder]
    if shutil.which("chattr") is None or any(
        subprocess.run(["chattr", "+i", str(f)], check=False).returncode for f in frozen_files
    ):
        pytest.skip("needs chattr +i")
    yield folder
    for f in frozen_files:
        subprocess.run(["chattr", "-i", str(f)], check=False)


def _bad_path(case: str, tmp_path: Path, frozen: Path) -> tuple[Path, str]:
    if case == "missing directory":
        return tmp_path / "no" / "such" / "run.jsonl", f"the directory {tmp_path / 'no'} does not exist"
    if case == "parent is a file":
        (tmp_path / "file").write_text("")
        return tmp_path / "file" / "run.jsonl", f"{tmp_path / 'file'} is a file, not a directory"
    if case == "path is a directory":
        return tmp_path, f"{tmp_path} is a directory"
    if case == "cannot create":
        return frozen / "new.jsonl", "Operation not permitted"
    if case == "cannot append":
        return frozen / "old.jsonl", "Operation not permitted"
    if case == "proc":
        return Path("/proc/streamwatch-run.jsonl"), "No such file or directory"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "missing directory",
        "parent is a file",
        "path is a directory",
        "cannot create",
        "cannot append",
        "proc",
    ],
)
def test_an_unusable_path_is_refused_when_the_sink_is_made(case: str, tmp_path: Path, frozen: Path) -> None:
    path, what = _bad_path(case, tmp_path, frozen)
    if case == "proc" and not Path("/proc").is_dir():
        pytest.skip("needs /proc")
    with pytest.raises(RunFileError, match=re.escape(what)) as info:
        RunFile(path)
    message = str(info.value)
    assert message.startswith(f"RunFile({str(path)!r}): ")
    assert re.search(r"; (create|choose|pass)", message), message  # and what to do


def test_checking_a_new_path_leaves_no_file_behind(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    sink = RunFile(path)
    assert not path.exists()  # created at the first step (or at close), as before
    sink.close()
    assert read_run(path).records == []


# -- report -------------------------------------------------------------------------------------------------


def test_report(trained: tuple[Path, list[StepRecord]]) -> None:
    path, reference = trained
    run = read_run(path)
    text = report(run, top=2)
    last = reference[-1]
    assert f"steps recorded: {STEPS} (steps 0..{STEPS - 1}, rank 0; {STEPS} with layer statistics)" in text
    assert f"last loss: {last.scalars['loss']:.6g} (step {last.step})" in text
    assert f"last accuracy: {last.scalars['accuracy']:.6g}" in text
    # first non-finite: the NaN input makes layer "0"'s activation the first non-finite row
    first = next(r for r in reference if (r.column("nonfinite") > 0).any())
    assert first.step == NAN_STEP
    row = int(np.flatnonzero(first.column("nonfinite") > 0)[0])
    assert first.keys[row].layer == "0"
    assert (
        f"first non-finite: step {NAN_STEP}, rank 0, layer '0', kind {first.keys[row].kind}, name '', "
        "direction forward" in text
    )

    def section(title: str) -> list[str]:
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith(title))
        found = []
        for line in lines[start + 1 :]:
            if not re.match(r"\s+\d+\.", line):
                break
            found.append(line.split()[1])
        return found

    # gradient norms: the layer's √Σ sumsq over its param_grad rows, numpy reference
    rows = last.rows("param_grad")
    layers = sorted({last.keys[i].layer for i in rows})
    norms = {
        layer: np.sqrt(np.sum([last.column("sumsq")[i] for i in rows if last.keys[i].layer == layer]))
        for layer in layers
    }
    expected = sorted(layers, key=lambda layer: -norms[layer])[:2]
    assert section("worst layers by gradient norm") == expected
    assert len(section("worst layers by gradient norm")) == 2
    # dead fractions of activations
    acts = last.rows("activation")
    dead = last.stat("dead_fraction")
    values = {last.keys[i].layer: float(dead[i]) for i in acts if not np.isnan(dead[i])}
    ranked = sorted(values, key=lambda layer: -values[layer])
    got = section("worst layers by dead fraction")
    assert len(got) == min(2, len(values))
    assert [values[layer] for layer in got] == [values[layer] for layer in ranked[:2]]
    assert got[0] == "1"  # the ReLU with dead units
    assert values["1"] == 0.25
    full = report(run)
    assert "first non-finite" in full
    assert "truncated" not in full


def test_report_of_an_empty_and_a_clean_run(tmp_path: Path) -> None:
    text = report(RunData(tmp_path / "x.jsonl", {}))
    assert "steps recorded: 0" in text
    assert "last loss: n/a" in text
    assert "first non-finite: none" in text
    path = tmp_path / "clean.jsonl"
    train(path, steps=2, nan_step=None)
    assert "first non-finite: none" in report(read_run(path))


# -- a killed process ---------------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys, torch, streamwatch as sw
    from streamwatch.sinks import RunFile
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = sw.observe(model, opt, sinks=[RunFile(sys.argv[1])], overflow="block", every=1)
    for _ in range(1_000_000):
        x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        opt.zero_grad(); loss.backward(); opt.step()
        watch.step(loss=loss, outputs=logits, targets=y, batch_size=16)
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_killed_process_leaves_every_completed_step(tmp_path: Path) -> None:
    path = tmp_path / "killed.jsonl"
    wanted = 20
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while True:  # poll the file itself until enough steps were flushed
            if path.exists() and len(step_lines(path)) >= wanted:
                break
            if child.poll() is not None:
                pytest.fail(f"the child exited early: {child.stderr.read().decode() if child.stderr else ''}")
            if time.monotonic() > deadline:
                pytest.fail("the child did not write enough steps in time")
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stderr is not None:
            child.stderr.close()
    complete = len(step_lines(path))
    assert complete >= wanted
    run = read_run(path)
    assert [r.step for r in run.records] == list(range(complete))  # every completed step, in order
    assert run.last_good_step == complete - 1
    assert all(np.isfinite(r.scalars["loss"]) and r.table.shape[1] == len(COLUMNS) for r in run.records)
    assert run.truncated == (not path.read_bytes().endswith(b"\n"))


def test_to_pandas_has_one_row_per_recorded_step(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[float] = []
    with sw.observe(model, opt, every=1, sinks=[RunFile(tmp_path / "run.jsonl")]) as watch:
        for step in range(3):
            loss = model(torch.randn(5, 3)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            grads.append(float(model[2].weight.grad.norm()))
            opt.step()
            watch.step(loss=loss, batch_size=5 if step else None)
    frame = read_run(tmp_path).to_pandas()
    assert isinstance(frame, pandas.DataFrame)
    assert list(frame.columns[:3]) == ["step", "rank", "time"]
    assert frame["step"].tolist() == [0, 1, 2]
    assert frame["rank"].tolist() == [0, 0, 0]
    assert {"loss", "lr/0", "batch_size"} <= set(frame.columns)
    assert frame["lr/0"].tolist() == [0.1] * 3
    assert math.isnan(frame["batch_size"][0])  # a step without it
    assert frame["batch_size"].tolist()[1:] == [5.0, 5.0]
    assert not any(":" in column for column in frame.columns)  # per-layer columns only when asked
    layers = read_run(tmp_path).to_pandas(stats=["l2", "max"])
    assert layers["train/2/param_grad/weight:l2"].tolist() == pytest.approx(grads, rel=1e-6)
    assert "train/0/activation:max" in layers.columns
    assert layers.shape[0] == 3
    with pytest.raises(ValueError, match=r"^Expected `stats` to name statistics of count, .*, got 'norm'$"):
        read_run(tmp_path).to_pandas(stats=["norm"])


def test_to_pandas_without_pandas_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"needs pandas: pip install 'streamwatch-torch\[pandas\]'"):
        RunData(tmp_path / "run.jsonl", {}).to_pandas()
