"""Replay: a recorded run served on /metrics with the live exporter's families and labels."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from streamwatch._replay import Replay
from streamwatch.sinks import RunData, RunFile, read_run
from tests.recording import record_run

STEPS = 10


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunData:
    path = tmp_path_factory.mktemp("myrun") / "run.jsonl"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    return record_run(path, model, x, y, STEPS, lr=0.1)


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_speed_zero_serves_the_last_record(run: RunData) -> None:
    last = run.records[-1]
    with Replay(run, port=0, speed=0) as replay:
        assert replay.wait_until_done(timeout=10)
        assert replay.current_step == last.step == STEPS - 1
        samples = _scrape(replay.url)
    assert _value(samples, "streamwatch_step") == last.step
    assert _value(samples, "streamwatch_loss", phase="train") == last.scalars["loss"]
    assert _value(samples, "streamwatch_accuracy", phase="train") == last.scalars["accuracy"]
    ident = {"run": "myrun0", "rank": str(last.rank)}  # on every series; the rest on streamwatch_info
    assert _value(samples, "streamwatch_info", **ident, local_rank="0", world_size="1") == 1
    checked = 0
    families = {  # one family per statistic, by the names docs/prometheus.md lists
        "count": "streamwatch_tensor_elements",
        "sumsq": "streamwatch_tensor_sum_of_squares",
        "min": "streamwatch_tensor_min",
        "max": "streamwatch_tensor_max",
        "l2": "streamwatch_tensor_l2",
        "mean": "streamwatch_tensor_mean",
        "dead_fraction": "streamwatch_tensor_dead_ratio",
    }
    for stat, family in families.items():
        values = last.stat(stat)
        for i, key in enumerate(last.keys):
            if values[i] != values[i]:  # NaN: absent, as the live exporter does
                wanted = key.labels().items()
                tensors = [set(ls) for (n, ls) in samples if n == family]
                assert not [ls for ls in tensors if wanted <= ls]
                continue
            got = _value(samples, family, **ident, **key.labels())
            assert got == float(values[i]), (key, stat)
            checked += 1
    assert checked > 50


def test_speed_advances_to_the_last_step(run: RunData) -> None:
    with Replay(run, port=0, speed=50).start() as replay:
        seen: set[float] = set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            samples = _scrape(replay.url)
            step = [v for (n, _), v in samples.items() if n == "streamwatch_step"]
            seen.update(step)
            if step == [STEPS - 1]:
                break
        assert seen, "never served a step"
        assert max(seen) == STEPS - 1
        assert replay.wait_until_done(timeout=5)


def test_close_stops_serving(run: RunData) -> None:
    replay = Replay(run, port=0, speed=0).start()
    url = replay.url
    assert _scrape(url)
    replay.close()
    replay.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        _scrape(url)


def test_loop_starts_over(run: RunData) -> None:
    with Replay(run, port=0, speed=200, loop=True) as replay:
        reached_last = restarted = False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not restarted:
            step = replay.current_step
            reached_last = reached_last or step == STEPS - 1
            restarted = reached_last and step is not None and step < STEPS - 1
            time.sleep(0.001)
        assert restarted
        assert not replay.wait_until_done(timeout=0)
    assert replay.wait_until_done(timeout=5)


def test_port_in_use_names_port_and_fix(run: RunData) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        replay = Replay(run, port=port, speed=0)
        with pytest.raises(OSError, match=rf"port {port}.*Replay\(port=\.\.\.\)"):
            replay.start()
        replay.close()


def test_bad_arguments(run: RunData) -> None:
    with pytest.raises(ValueError, match="speed"):
        Replay(run, speed=-1)
    with pytest.raises(ValueError, match="port"):
        Replay(run, port=70000)


def test_run_label_argument_and_empty_run(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    RunFile(path).close()
    with Replay(read_run(path), port=0, speed=0, run_name="custom") as replay:
        assert replay.wait_until_done(timeout=5)
        assert replay.current_step is None
        samples = _scrape(replay.url)
    assert _value(samples, "streamwatch_info", run="custom") == 1
    assert not [n for n, _ in samples if n == "streamwatch_step"]


@pytest.mark.parametrize("empty", [False, True], ids=["records", "header only"])
def test_loop_with_nothing_to_repeat_serves_until_close_without_spinning(
    run: RunData, empty: bool, tmp_path: Path
) -> None:
    """speed=0 (or no records) with loop=True: the stepping thread sleeps until close(), serving the
    last state; it does not re-send the records in a busy loop."""
    if empty:
        path = tmp_path / "run.jsonl"
        RunFile(path).close()
        run = read_run(path)
    with Replay(run, port=0, speed=0, loop=True) as replay:
        time.sleep(0.3)
        records = replay.statistics().records_received
        assert records == len(run.records)  # one pass, not one per spin
        time.sleep(0.3)
        assert replay.statistics().records_received == records
        assert replay.current_step == (None if empty else STEPS - 1)
        assert not replay.wait_until_done(timeout=0)
        assert "streamwatch_info" in {n for n, _ in _scrape(replay.url)}
    assert replay.wait_until_done(timeout=5)


def test_a_fast_loop_pauses_between_passes(run: RunData) -> None:
    """At 1e9 steps/s a pass takes nanoseconds: the pause after it makes each pass last at least
    MIN_PASS_SECONDS, so looping does not spin a core."""
    from streamwatch._replay import MIN_PASS_SECONDS

    with Replay(run, port=0, speed=1e9, loop=True) as replay:
        time.sleep(0.5)
        passes = replay.statistics().records_received / STEPS
    assert passes <= 0.5 / MIN_PASS_SECONDS + 1


def test_a_tiny_speed_waits_instead_of_overflowing(run: RunData) -> None:
    """speed=1e-300: the next record is ~1e300 s away; the wait is taken in pieces (one Event.wait of
    1e300 s would raise OverflowError on the stepping thread and end the replay)."""
    with Replay(run, port=0, speed=1e-300) as replay:
        deadline = time.monotonic() + 5
        while replay.current_step is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert replay.current_step == 0
        assert not replay.wait_until_done(timeout=0.3)  # still stepping (asleep), not dead
    assert replay.wait_until_done(timeout=5)


def test_a_run_file_with_two_ranks_serves_one_rank_under_its_label(run: RunData) -> None:
    # rank 1's records interleaved with rank 0's (a concatenation of two ranks' runs): one endpoint served
    # the last record of either rank under rank="0", and counted both ranks' records
    import dataclasses

    doubled = []
    for record in run.records:
        other = dataclasses.replace(
            record, rank=1, scalars={**record.scalars, "loss": record.scalars["loss"] + 1}
        )
        doubled += [record, other]
    both = dataclasses.replace(run, records=doubled)
    for rank in (None, 1):
        with Replay(both, port=0, speed=0, rank=rank) as replay:
            assert replay.ranks == (0, 1)
            assert replay.wait_until_done(timeout=10)
            samples = _scrape(replay.url)
        served = 0 if rank is None else 1
        last = [r for r in doubled if r.rank == served][-1]
        assert _value(samples, "streamwatch_loss", phase="train", rank=str(served)) == last.scalars["loss"]
        assert _value(samples, "streamwatch_records_total") == STEPS  # one rank's records
    with pytest.raises(ValueError, match="no record of rank 2; its ranks: 0, 1"):
        Replay(both, port=0, rank=2)
