"""A real 2-rank ``torchrun`` DDP run on gloo, each rank on its own port, scraped by a real Prometheus.

Checks: both ranks up with their identity (``rank``, ``local_rank``, ``world_size``); every value
Prometheus holds for a rank equals that rank's final ``watch.snapshot()``; the weights (identical
across DDP ranks after every step) export identical sums of squares from both ranks; per-rank step
phase times are there; and streamwatch never issued a collective of its own (the run would deadlock or
diverge otherwise — the ranks only all-reduce inside DDP).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from streamwatch import Sample
from streamwatch._families import exposed_sample
from tests.promserver import PrometheusServer, require_prometheus
from tests.torchrun import finish, free_ports, launch

SCRIPT = Path(__file__).parent / "scripts" / "ddp_train.py"
IDENTITY = ("run", "rank", "local_rank", "world_size", "host", "job", "instance", "__name__")


def _torchrun(out: Path, base: int, *extra: str) -> subprocess.Popen[bytes]:
    return launch(SCRIPT, 2, out, "--port", str(base), "--out", str(out), *extra)


@pytest.mark.timeout(180)
def test_two_ranks_on_their_own_ports_scraped_by_prometheus(tmp_path: Path) -> None:
    require_prometheus()
    base = free_ports(2)
    out = tmp_path / "run"
    out.mkdir()
    proc = _torchrun(out, base)
    try:
        targets = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
        with PrometheusServer(tmp_path / "prom", targets) as prom:
            prom.wait_for('count(up{job="streamwatch"} == 1) == 2', bool, timeout=90)
            snapshots = {}
            for rank in (0, 1):
                path = out / f"snapshot-{rank}.json"
                prom.wait_for(f'streamwatch_step{{rank="{rank}"}} == 29', bool, timeout=90)
                assert path.exists(), (out / "torchrun.log").read_text(errors="replace")[-3000:]
                snapshots[rank] = json.loads(path.read_text())
            info = prom.query('streamwatch_info{run="ddp"}')
            assert sorted((s["metric"]["rank"], s["metric"]["local_rank"]) for s in info) == [
                ("0", "0"),
                ("1", "1"),
            ]
            assert {s["metric"]["world_size"] for s in info} == {"2"}
            assert {s["metric"]["instance"] for s in info} == set(targets)  # rank r on base + local_rank
            for rank, snapshot in snapshots.items():
                assert snapshot["port"] == base + rank
                _assert_served_equals_snapshot(prom, rank, snapshot["samples"])
            weights = prom.query('streamwatch_tensor_sum_of_squares{run="ddp", kind="param"}')
            by_rank: dict[str, dict[tuple[str, str], str]] = {}
            for series in weights:
                m = series["metric"]
                by_rank.setdefault(m["rank"], {})[(m["layer"], m["param"])] = series["value"][1]
            assert by_rank["0"] == by_rank["1"]  # DDP keeps the replicas identical
            parts = prom.query('streamwatch_step_phase_seconds{run="ddp"}')
            assert {(s["metric"]["rank"], s["metric"]["part"]) for s in parts} == {
                (r, p) for r in ("0", "1") for p in ("data_wait", "forward", "backward", "optimizer")
            }
    finally:
        finish(proc, out)


def _assert_served_equals_snapshot(prom: PrometheusServer, rank: int, samples: list[dict[str, Any]]) -> None:
    # the snapshot's streamwatch_tensor{stat=...} as /metrics serves it: one family per statistic
    exposed = [exposed_sample(Sample(s["name"], s["labels"], s["value"])) for s in samples]
    want = {
        (e.name, tuple(sorted((k, v) for k, v in e.labels.items() if v))): e.value
        for e in exposed
        if e.name.startswith("streamwatch_tensor_") or e.name in ("streamwatch_loss", "streamwatch_accuracy")
    }
    got = {}
    names = "streamwatch_tensor_.+|streamwatch_loss|streamwatch_accuracy"
    selector = f'{{__name__=~"{names}", run="ddp", rank="{rank}"}}'
    for series in prom.query(selector):
        labels = tuple(sorted((k, v) for k, v in series["metric"].items() if k not in IDENTITY))
        assert "stat" not in series["metric"]
        assert "host" not in series["metric"]
        got[(series["metric"]["__name__"], labels)] = float(series["value"][1])
    assert len(want) > 50
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == value, (rank, key)


@pytest.mark.timeout(180)
def test_injected_faults_on_one_rank_fire_the_non_finite_and_straggler_alerts(tmp_path: Path) -> None:
    """NaN in rank 0's loss from the middle of the run on, and a 50 ms sleep before every forward of rank
    1: the shipped alert rules (only their ``for:`` shortened) fire for exactly those ranks."""
    from tests.test_rules import RULES, rules_with_short_for

    require_prometheus()
    rules = RULES.read_text()
    for alert in ("StreamwatchNonFiniteValues", "StreamwatchStragglerRank"):
        rules = rules_with_short_for(rules, alert, "1s")
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(rules)
    base = free_ports(2)
    out = tmp_path / "run"
    out.mkdir()
    # 80 steps (about 4.5 s with the slow rank's sleeps): several 1 s scrapes see the step counters move
    # while it trains (the straggler rule reads their rate; a run over before the first scrape has none)
    proc = _torchrun(out, base, "--nan-rank", "0", "--slow-rank", "1", "--steps", "80")
    try:
        targets = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
        with PrometheusServer(tmp_path / "prom", targets, rule_files=[rule_file]) as prom:
            prom.wait_for('count(streamwatch_step{run="ddp"} == 79) == 2', bool, timeout=90)

            def firing(alertname: str) -> set[str]:
                return {
                    a["labels"]["rank"]
                    for a in prom.alerts()
                    if a["labels"].get("alertname") == alertname and a["state"] == "firing"
                }

            for alertname, rank in (("StreamwatchNonFiniteValues", "0"), ("StreamwatchStragglerRank", "1")):
                prom.wait_for(
                    f'ALERTS{{alertname="{alertname}", alertstate="firing", rank="{rank}"}}', bool, timeout=60
                )
            assert firing("StreamwatchStragglerRank") == {"1"}  # only the slow rank
            assert "0" in firing("StreamwatchNonFiniteValues")
    finally:
        finish(proc, out)
