"""The Grafana dashboards in ``dashboards/``: generated, schema-valid, and linted. No network, no server.

* the committed JSON is exactly what ``dashboards/generate.py`` produces (drift check);
* each dashboard validates against Grafana's strict JSON schema (``../shared/grafana``; skipped in a
  clone without it);
* lint: units, ``{{rank}}`` in legends, the 24-column grid without overlaps, ``$__rate_interval`` in every
  ``rate``/``increase``, the variable chain job → run → rank → layer, unique stable UIDs, ``job``/``run``
  selectors on every series selector, and (with ``promtool``) every query parses as PromQL;
* the scrape-config example is a valid Prometheus config (with ``promtool``).

``tests/test_dashboards_e2e.py`` runs every query against a real Prometheus scraping a real training run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS_DIR = ROOT / "dashboards"
GENERATOR = DASHBOARDS_DIR / "generate.py"
SCHEMA = Path(__file__).resolve().parents[2] / "shared/grafana/dashboard.jsonschema.json"

EXPECTED_UIDS = {
    "streamwatch-overview.json": "streamwatch-overview",
    "streamwatch-layers.json": "streamwatch-layers",
    "streamwatch-cluster.json": "streamwatch-cluster",
    "streamwatch-health.json": "streamwatch-health",
}

# Panels whose legend has no {{rank}} because the query aggregates across ranks by design.
ACROSS_RANKS = {
    ("streamwatch-overview.json", "Global grad norm"),  # exact norm over every layer and rank
    ("streamwatch-overview.json", "Global gradient norm"),
    ("streamwatch-cluster.json", "Ranks reporting"),  # count of ranks
    ("streamwatch-cluster.json", "Slowest / median step time"),  # max / median over ranks
    ("streamwatch-cluster.json", "Slowest rank vs median"),
    ("streamwatch-layers.json", "Parameter-gradient values (histogram)"),  # one heatmap row per le bucket
}

VARIABLE_CHAIN = ["datasource", "job", "run", "rank", "worst", "layer"]


def load_generator() -> ModuleType:
    """Import ``dashboards/generate.py`` (not a package) as a module."""
    spec = importlib.util.spec_from_file_location("streamwatch_dashboards_generate", GENERATOR)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up in sys.modules
    spec.loader.exec_module(module)
    return module


def committed() -> dict[str, dict[str, Any]]:
    """The committed dashboards, by file name."""
    return {path.name: json.loads(path.read_text(encoding="utf-8")) for path in DASHBOARDS_DIR.glob("*.json")}


def panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows, rows included."""
    for panel in model["panels"]:
        yield panel
        yield from panel.get("panels", [])


def query_panels(model: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel that is not a row."""
    return (p for p in panels(model) if p["type"] != "row")


def exprs(model: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(panel title, target) for every target of every panel."""
    for panel in query_panels(model):
        for target in panel["targets"]:
            yield panel["title"], target


DASHBOARD_NAMES = sorted(EXPECTED_UIDS)


# -- generated, committed, schema-valid ---------------------------------------------------------------------


def test_the_committed_json_is_what_the_generator_produces() -> None:
    generator = load_generator()
    assert sorted(generator.DASHBOARDS) == DASHBOARD_NAMES
    assert generator.check() == [], "run `make dashboards` and commit the result"
    rendered = generator.render()
    assert {p.name for p in DASHBOARDS_DIR.glob("*.json")} == {n for n in rendered if n.endswith(".json")}
    assert {f"kubernetes/{p.name}" for p in (DASHBOARDS_DIR / "kubernetes").iterdir()} == {
        n for n in rendered if n.startswith("kubernetes/")
    }


def test_the_drift_check_cli_passes_and_names_a_drifted_file(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    generator = load_generator()
    for name, text in generator.render().items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert generator.check(tmp_path) == []
    drifted = tmp_path / "streamwatch-health.json"
    drifted.write_text(drifted.read_text(encoding="utf-8").replace("Queue length", "Queue"), encoding="utf-8")
    (tmp_path / "streamwatch-layers.json").unlink()
    (tmp_path / "kubernetes" / "podmonitor.yaml").unlink()
    assert generator.check(tmp_path) == [
        "streamwatch-layers.json",
        "streamwatch-health.json",
        "kubernetes/podmonitor.yaml",
    ]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_each_dashboard_validates_against_grafanas_strict_schema(name: str) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"the Grafana dashboard schema is not here ({SCHEMA}): only in the project's workspace")
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in validator.iter_errors(committed()[name])]
    assert errors == []


# -- lint ---------------------------------------------------------------------------------------------------


def test_uids_are_stable_and_unique_and_panel_ids_unique() -> None:
    models = committed()
    assert {name: model["uid"] for name, model in models.items()} == EXPECTED_UIDS
    for name, model in models.items():
        ids = [p["id"] for p in panels(model)]
        assert len(ids) == len(set(ids)), name
        assert "streamwatch" in model["tags"]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_every_panel_has_a_unit_a_datasource_and_queries(name: str) -> None:
    for panel in query_panels(committed()[name]):
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_every_legend_names_the_rank_unless_allow_listed(name: str) -> None:
    for title, target in exprs(committed()[name]):
        if (name, title) in ACROSS_RANKS:
            # aggregated across ranks: then the query must not keep the rank either (its outermost
            # aggregation, the first; an inner one may sum per rank first, as the global norm does)
            outermost = re.search(r"by \(([^)]*)\)", target["expr"])
            assert outermost is None or not re.search(r"\brank\b", outermost[1]), (title, target["expr"])
            continue
        assert "{{rank}}" in target.get("legendFormat", ""), (title, target.get("legendFormat"))


def test_the_across_ranks_allow_list_names_existing_panels() -> None:
    models = committed()
    titles = {(name, p["title"]) for name, model in models.items() for p in query_panels(model)}
    assert titles >= ACROSS_RANKS


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_the_grid_is_24_wide_without_overlaps(name: str) -> None:
    boxes = []
    for panel in panels(committed()[name]):
        if panel["type"] == "row" and panel.get("repeat") is None and panel.get("collapsed"):
            continue
        pos = panel["gridPos"]
        assert min(pos["x"], pos["y"]) >= 0, panel["title"]
        assert min(pos["w"], pos["h"]) > 0, panel["title"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        boxes.append((panel["title"], pos["x"], pos["y"], pos["x"] + pos["w"], pos["y"] + pos["h"]))
    for i, (ta, ax0, ay0, ax1, ay1) in enumerate(boxes):
        for tb, bx0, by0, bx1, by1 in boxes[i + 1 :]:
            overlap = ax0 < bx1 and bx0 < ax1 and ay0 < by1 and by0 < ay1
            assert not overlap, f"{ta!r} overlaps {tb!r}"


def _call_bodies(expr: str, functions: tuple[str, ...]) -> Iterator[str]:
    """The argument text of every call of one of ``functions`` in ``expr`` (balanced parentheses)."""
    for match in re.finditer(r"\b(" + "|".join(functions) + r")\s*\(", expr):
        depth, start = 1, match.end()
        i = start
        while depth and i < len(expr):
            depth += {"(": 1, ")": -1}.get(expr[i], 0)
            i += 1
        yield expr[start : i - 1]


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_every_rate_and_increase_uses_rate_interval(name: str) -> None:
    for title, target in exprs(committed()[name]):
        for body in _call_bodies(target["expr"], ("rate", "irate", "increase", "delta", "deriv")):
            windows = re.findall(r"\[([^\]]*)\]", body)
            assert windows == ["$__rate_interval"], (title, target["expr"])


SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")


@pytest.mark.parametrize("name", DASHBOARD_NAMES)
def test_every_query_looks_like_promql_and_selects_job_and_run(name: str) -> None:
    for title, target in exprs(committed()[name]):
        expr = target["expr"]
        for opening, closing in ("()", "{}", "[]"):
            assert expr.count(opening) == expr.count(closing), (title, expr)
        assert expr.count('"') % 2 == 0, (title, expr)
        # no bare metric name: every streamwatch_ series is selected with labels
        assert not re.search(r"\bstreamwatch_[a-z_]+\b(?!\{)", expr), (title, expr)
        selectors = SELECTOR.findall(expr)
        assert selectors, (title, expr)
        for metric, labels in selectors:
            assert 'job=~"$job"' in labels, (title, expr)
            if metric != "up":  # Prometheus' own series has no run label: joined with streamwatch_info
                assert 'run=~"$run"' in labels, (title, expr)
        assert target["refId"]
        # time series, except the alerts table (the alerts firing now)
        assert target["range"] is True or (target["instant"] and target["format"] == "table"), title


def test_the_variables_chain_job_run_rank_layer() -> None:
    for name, model in committed().items():
        variables = model["templating"]["list"]
        assert [v["name"] for v in variables] == VARIABLE_CHAIN, name
        by_name = {v["name"]: v for v in variables}
        assert by_name["datasource"]["type"] == "datasource"
        assert by_name["datasource"]["query"] == "prometheus"
        assert by_name["job"]["query"] == "label_values(streamwatch_info, job)"
        assert by_name["run"]["query"] == 'label_values(streamwatch_info{job=~"$job"}, run)'
        assert by_name["rank"]["query"] == 'label_values(streamwatch_info{job=~"$job",run=~"$run"}, rank)'
        # $layer: the $worst worst layers of the selected ranks, worst first, "All" of them by default
        layer = by_name["layer"]
        assert layer["query"].startswith("query_result(topk($worst, "), layer["query"]
        assert 'rank=~"$rank"' in layer["query"]
        assert layer["regex"] == '/layer="([^"]+)"/'
        assert layer["sort"] == 0, "no sort: the worst layer first"
        assert layer["current"] == {"selected": True, "text": "All", "value": "$__all"}
        worst = by_name["worst"]
        assert worst["type"] == "custom"
        assert worst["query"].split(",")[0] == worst["current"]["value"] == "5"
        for var in ("job", "run", "rank", "layer"):
            v = by_name[var]
            assert (v["type"], v["multi"], v["includeAll"]) == ("query", True, True), (name, var)
            assert v["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert v["refresh"] == 2, "refresh on time-range change, so new runs and ranks appear"


def test_the_layers_dashboard_repeats_a_collapsed_row_per_layer() -> None:
    """A collapsed row per selected layer: a layer's queries run only when its row is opened."""
    layers = committed()["streamwatch-layers.json"]
    repeated = [p for p in layers["panels"] if p.get("repeat") == "layer"]
    assert len(repeated) == 1
    row = repeated[0]
    assert (row["type"], row["collapsed"]) == ("row", True)
    assert layers["panels"][-1] is row  # nothing after it: its panels are nested, as Grafana stores them
    assert len(row["panels"]) >= 6
    for panel in row["panels"]:
        assert any('layer=~"$layer"' in t["expr"] for t in panel["targets"]), panel["title"]
    assert {p["type"] for p in query_panels(layers)} >= {"heatmap", "timeseries"}
    open_rows = [p for p in layers["panels"] if p["type"] == "row" and not p["collapsed"]]
    assert all(not p["panels"] for p in open_rows)


def test_the_overview_lists_alerts_and_every_dashboard_annotates_events() -> None:
    models = committed()
    tables = [p for p in query_panels(models["streamwatch-overview.json"]) if p["type"] == "table"]
    assert len(tables) == 1
    (target,) = tables[0]["targets"]
    assert target["expr"].startswith("ALERTS{")
    assert 'run=~"$run"' in target["expr"]
    for name, model in models.items():
        annotations = {a["name"]: a for a in model["annotations"]["list"]}
        assert {"Loss spikes", "First non-finite step", "Firing alerts"} <= set(annotations), name
        for annotation in annotations.values():
            if annotation["name"] in ("Annotations & Alerts",):  # Grafana's built-in one, if any
                continue
            assert 'job=~"$job"' in annotation["target"]["expr"], (name, annotation["name"])


def test_the_minimum_grafana_version_is_stated() -> None:
    generator = load_generator()
    readme = (DASHBOARDS_DIR / "README.md").read_text(encoding="utf-8")
    assert f"Grafana {generator.MIN_GRAFANA} or newer" in readme
    for model in committed().values():
        assert model["description"].endswith(f"Grafana {generator.MIN_GRAFANA} or newer.")


def _substituted(expr: str) -> str:
    """An expression with every dashboard variable replaced by something PromQL accepts."""
    expr = expr.replace("$__rate_interval", "1m").replace("$__interval", "15s")
    return re.sub(r"\$\{?(\w+)\}?", ".*", expr)


def test_every_query_parses_with_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (the Debian package prometheus)")
    rules = []
    for name, model in sorted(committed().items()):
        for i, (_title, target) in enumerate(exprs(model)):
            record = f"dash:{name.removesuffix('.json').replace('-', '_')}:{i}"
            rules.append({"record": record, "expr": _substituted(target["expr"])})
    path = tmp_path / "rules.yml"  # JSON is valid YAML
    path.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}), encoding="utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_scrape_config_example_is_valid(tmp_path: Path) -> None:
    targets = json.loads((DASHBOARDS_DIR / "scrape/file_sd.json").read_text(encoding="utf-8"))
    assert targets
    assert all(group["targets"] for group in targets)
    provisioning = DASHBOARDS_DIR / "provisioning"
    assert "apiVersion: 1" in (provisioning / "dashboards.yaml").read_text(encoding="utf-8")
    assert "type: prometheus" in (provisioning / "datasources.yaml").read_text(encoding="utf-8")
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (the Debian package prometheus) to check the Prometheus config")
    # copy the example so that promtool resolves file_sd.json next to it, as a user would lay it out
    for name in ("prometheus.yml", "file_sd.json"):
        shutil.copy(DASHBOARDS_DIR / "scrape" / name, tmp_path / name)
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
