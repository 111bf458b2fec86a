"""Exact norms of sharded and replicated parameters, from per-rank sums of squares, in a real Prometheus.

Real ``torchrun`` jobs on gloo (``tests/scripts/sharded_train.py``), each rank serving /metrics on its own
port, scraped by a real Prometheus (``tests/promserver.py``):

* **FSDP2** (``fully_shard``) at 2 and 4 ranks: each rank exports the sums of squares and counts of its
  own shards (it does: each rank's value equals its ``to_local()`` shard's, and the number of ranks per
  parameter is the number of non-empty shards), and ``sqrt(sum by (run, layer, param) (sumsq))`` equals
  the norm of the unsharded weight, gradient and update that torch computes from ``full_tensor()``, to
  rel 1e-5; the counts add up to ``numel`` exactly; the global norms too.
* **DDP** at 4 ranks, with a callable ``detail=`` (ranks 0 and 2 keep per-layer series, 1 and 3 serve
  totals) and rank 3 a straggler: weights, updates and gradients are replicated (the gradient is read
  at the optimizer's pre-step, after DDP averaged it), so ``max by (run, layer, param)`` is the model's
  norm (and ``min`` equals ``max``); every rank, with or without per-layer detail, gives the global
  weight, gradient and update norms exactly.
* At 4 ranks, every query of the Cluster dashboard returns data for every rank (the panels that aggregate
  across ranks return data), and the straggler rules record every rank and fire for the slow rank only.

Skipped without the ``prometheus`` binary, except under ``STREAMWATCH_REQUIRE_PROMETHEUS=1``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from streamwatch._summary import derive
from streamwatch.testing import table
from tests.promserver import PrometheusServer, require_prometheus
from tests.test_dashboards import exprs, load_generator
from tests.test_dashboards_e2e import all_values, resolve_variables, substitute
from tests.test_rules import RULES, rules_with_short_for
from tests.torchrun import finish, free_ports, launch

SCRIPT = Path(__file__).parent / "scripts" / "sharded_train.py"
STEPS = 12
REL = 1e-5
KINDS = ("param", "param_grad", "update")
PARAMS = [(str(layer), name) for layer in (0, 2, 4) for name in ("weight", "bias")]
SHAPES = {"0": (32, 16), "2": (24, 32), "4": (5, 24)}  # the script's Linear layers: (rows, columns)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


@contextmanager
def _job(
    tmp_path: Path, mode: str, ranks: int, *extra: str, rules: Path | None = None
) -> Iterator[tuple[PrometheusServer, list[dict[str, Any]], str]]:
    """Run ``sharded_train.py`` on ``ranks`` ranks and a Prometheus scraping them; yields the server, each
    rank's reference values and the run label once every rank has served its last step."""
    run = f"{mode}{ranks}"
    out = tmp_path / run
    out.mkdir()
    base = free_ports(ranks)
    args = ("--mode", mode, "--port", str(base), "--out", str(out), "--name", run, "--steps", str(STEPS))
    proc = launch(SCRIPT, ranks, out, *args, *extra)
    try:
        targets = [f"127.0.0.1:{base + i}" for i in range(ranks)]
        rule_files = [rules] if rules is not None else []
        with PrometheusServer(tmp_path / f"prom-{run}", targets, rule_files=rule_files) as prom:
            deadline = time.monotonic() + 150
            while not all((out / f"ref-{r}.json").exists() for r in range(ranks)):
                assert proc.poll() is None, (out / "torchrun.log").read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, "the ranks did not finish training in time"
                time.sleep(0.2)
            refs = [json.loads((out / f"ref-{r}.json").read_text()) for r in range(ranks)]
            prom.wait_for(f'count(streamwatch_step{{run="{run}"}} == {STEPS - 1}) == {ranks}', timeout=60)
            yield prom, refs, run
    finally:
        finish(proc, out)


def _by(prom: PrometheusServer, promql: str, *labels: str) -> dict[tuple[str, ...], float]:
    """An instant vector as ``{label values: value}``."""
    out = {}
    for series in prom.query(promql):
        key = tuple(series["metric"].get(label, "") for label in labels)
        assert key not in out, (promql, key)
        out[key] = float(series["value"][1])
    return out


def _sumsq(run: str, kind: str, extra: str = "") -> str:
    return f'streamwatch_tensor_sum_of_squares{{run="{run}", phase="train", kind="{kind}"{extra}}}'


def _close(got: float, want: float, rel: float = REL) -> bool:
    return math.isclose(got, want, rel_tol=rel, abs_tol=0.0)


def _numel(layer: str, name: str) -> int:
    rows, columns = SHAPES[layer]
    return rows * columns if name == "weight" else rows


def _shards(numel_rows: int, ranks: int) -> list[int]:
    """Rows of each rank's dim-0 shard, as FSDP2 chunks them (``torch.chunk``: ceil-sized, trailing empty)."""
    size = -(-numel_rows // ranks)
    return [max(0, min(size, numel_rows - r * size)) for r in range(ranks)]


# -- FSDP2 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
def test_fsdp2_shards_sum_to_the_unsharded_norms(tmp_path: Path, ranks: int) -> None:
    require_prometheus()
    with _job(tmp_path, "fsdp2", ranks) as (prom, refs, run):
        full = refs[0]["full"]
        assert all(ref["full"] == full for ref in refs)  # full_tensor() is the same tensor everywhere
        for kind in KINDS:
            # the documented query: one norm per parameter from every rank's shard
            norms = _by(prom, f"sqrt(sum by (run, layer, param) ({_sumsq(run, kind)}))", "layer", "param")
            assert sorted(norms) == sorted(PARAMS), kind
            for layer, name in PARAMS:
                want = math.sqrt(full[f"{layer}.{name}"][kind])
                assert want > 0
                assert _close(norms[(layer, name)], want), (kind, layer, name, norms[(layer, name)], want)
            # each rank serves its own shard: its value is its to_local() shard's, and only ranks that
            # hold a non-empty shard serve one (the 5-row layer has an empty shard at 4 ranks)
            per_rank = _by(prom, _sumsq(run, kind), "rank", "layer", "param")
            for layer, name in PARAMS:
                holders = [r for r, rows in enumerate(_shards(SHAPES[layer][0], ranks)) if rows]
                assert sorted(int(r) for r, lay, p in per_rank if (lay, p) == (layer, name)) == holders
                for r in holders:
                    want = refs[r]["local"][f"{layer}.{name}"][kind]
                    assert _close(per_rank[(str(r), layer, name)], want, 1e-6), (kind, r, layer, name)
            counts = _by(
                prom,
                f'sum by (layer, param) (streamwatch_tensor_elements{{run="{run}", kind="{kind}"}})',
                "layer",
                "param",
            )
            assert counts == {(lay, p): float(_numel(lay, p)) for lay, p in PARAMS}, kind
            total = _by(prom, f"sqrt(sum by (run) ({_sumsq(run, kind)}))", "run")
            want = math.sqrt(sum(v[kind] for v in full.values()))
            assert _close(total[(run,)], want), (kind, total, want)
            _assert_shape_of_unsharded(prom, run, kind, full)
        if ranks == 4:
            _assert_cluster_dashboard(prom, run, ranks)


def _assert_shape_of_unsharded(prom: PrometheusServer, run: str, kind: str, full: dict[str, Any]) -> None:
    """The ranks' sums of |x|, x³ and x⁴ add up to the unsharded tensor's like its sums of squares, so
    its mean |x|, skewness and kurtosis follow from the summed series (``sum by (run, layer, param)``)."""
    sums = {
        stat: _by(
            prom,
            f'sum by (layer, param) ({family}{{run="{run}", kind="{kind}"}})',
            "layer",
            "param",
        )
        for stat, family in (
            ("count", "streamwatch_tensor_elements"),
            ("sum", "streamwatch_tensor_sum_of_values"),
            ("sumsq", "streamwatch_tensor_sum_of_squares"),
            ("sumabs", "streamwatch_tensor_sum_of_magnitudes"),
            ("sumcube", "streamwatch_tensor_sum_of_cubes"),
            ("sumfourth", "streamwatch_tensor_sum_of_fourth_powers"),
        )
    }
    for layer, name in PARAMS:
        want = full[f"{layer}.{name}"][f"{kind}_sums"]
        got = {stat: values[(layer, name)] for stat, values in sums.items()}
        for stat in ("sumabs", "sumfourth"):
            assert _close(got[stat], want[stat]), (kind, layer, name, stat, got[stat], want[stat])
        assert math.isclose(got["sumcube"], want["sumcube"], rel_tol=REL, abs_tol=1e-6 * want["abs_cube"])
        derived = derive(table(**got))
        n = got["count"]
        mean = want["sum"] / n
        m2 = want["sumsq"] / n - mean**2
        m4 = (
            want["sumfourth"] / n
            - 4 * mean * want["sumcube"] / n
            + 6 * mean**2 * want["sumsq"] / n
            - 3 * mean**4
        )
        assert float(derived["mean_abs"][0]) == pytest.approx(want["sumabs"] / n, rel=REL)
        kurtosis = float(derived["kurtosis"][0])  # (NaN where the sums cannot give it: never here)
        assert kurtosis == pytest.approx(m4 / m2**2, rel=1e-4), (kind, layer, name)


# -- DDP, mixed detail, the Cluster dashboard and the straggler rules ---------------------------------------


def test_ddp_replicated_norms_mixed_detail_dashboard_and_straggler(tmp_path: Path) -> None:
    require_prometheus()
    rules = tmp_path / "rules.yml"
    rules.write_text(rules_with_short_for(RULES.read_text(), "StreamwatchStragglerRank", "1s"))
    ranks = 4
    with _job(tmp_path, "ddp", ranks, "--detail", "even", "--slow-rank", "3", rules=rules) as (
        prom,
        refs,
        run,
    ):
        full = refs[0]["full"]
        # per-layer series only on the detail ranks (0 and 2: rank % 2 == 0), totals only on the others
        layered = _by(
            prom, f'count by (rank) (streamwatch_tensor_l2{{run="{run}", layer!="__all__"}})', "rank"
        )
        totals = _by(prom, f'count by (rank) (streamwatch_tensor_l2{{run="{run}", layer="__all__"}})', "rank")
        assert sorted(layered) == [("0",), ("2",)]
        assert sorted(totals) == [("1",), ("3",)]
        for kind in KINDS:  # replicated: every detail rank serves the same value (gradients: averaged)
            layers = _sumsq(run, kind, ', layer!="__all__"')  # per layer: leave the totals out
            top = _by(prom, f"sqrt(max by (run, layer, param) ({layers}))", "layer", "param")
            low = _by(prom, f"sqrt(min by (run, layer, param) ({layers}))", "layer", "param")
            assert sorted(top) == sorted(PARAMS), kind
            assert top == low, kind
            for layer, name in PARAMS:
                assert _close(top[(layer, name)], math.sqrt(full[f"{layer}.{name}"][kind])), (kind, layer)
            # the global norm from every rank, per-layer rows or totals alike: sum over layers per rank
            per_rank = _by(prom, f"sqrt(sum by (run, rank) ({_sumsq(run, kind)}))", "rank")
            want = math.sqrt(sum(v[kind] for v in full.values()))
            assert sorted(per_rank) == [(str(r),) for r in range(ranks)]
            assert all(_close(v, want) for v in per_rank.values()), (kind, per_rank, want)
            replicated = _by(prom, f"sqrt(max by (run) (sum by (run, rank) ({_sumsq(run, kind)})))", "run")
            assert _close(replicated[(run,)], want)
        _assert_cluster_dashboard(prom, run, ranks)
        # the recording rule has every rank (once evaluated after every rank's first scrape)
        recorded = f'streamwatch:step_own_seconds{{run="{run}"}}'
        prom.wait_for(f"count({recorded}) == {ranks}", timeout=30)
        assert sorted(_by(prom, recorded, "rank")) == [(str(r),) for r in range(ranks)]
        # the alert fires for the slow rank and no other (polled: it needs two evaluations, `for: 1s`)
        deadline, firing = time.monotonic() + 60, set()
        while firing != {"3"} and time.monotonic() < deadline:
            time.sleep(0.5)
            firing = {
                a["labels"]["rank"]
                for a in prom.alerts()
                if a["labels"].get("alertname") == "StreamwatchStragglerRank"
                and a["labels"].get("run") == run
                and a["state"] == "firing"
            }
        assert firing == {"3"}


def _assert_cluster_dashboard(prom: PrometheusServer, run: str, ranks: int) -> None:
    """Every query of the Cluster dashboard, with every variable at "All" (run: this run), returns data;
    each query that keeps the rank label returns every rank (``topk(1, ...)`` picks one by design)."""
    model = load_generator().build("streamwatch-cluster.json")
    values = resolve_variables(prom, model, all_values)
    values["run"] = run
    everyone = {str(r) for r in range(ranks)}
    for title, target in exprs(model):
        query = substitute(target["expr"], values)
        # A rate needs two scrapes of each rank inside its short window: on a loaded machine a scrape can
        # time out, so the query is asked again for a while before a missing rank counts as missing.
        deadline = time.monotonic() + 15
        while True:
            result = prom.query(query)
            seen = {series["metric"].get("rank") for series in result}
            whole = None in seen or title == "Slowest rank" or seen == everyone
            if (result and whole) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert result, f"{title}: no data: {query}"
        if None in seen or title == "Slowest rank":
            continue  # aggregated across ranks on purpose
        assert seen == everyone, f"{title}: ranks {sorted(seen)} of {sorted(everyone)}: {query}"
