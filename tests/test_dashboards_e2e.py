"""Every panel query of every dashboard returns data from a real Prometheus scraping a real training run.

A small torch model trains with ``watch.expose(port=0, run="dash")``, the opt-in histogram and the
overhead governor (``overhead=``, so that ``streamwatch_overhead_ratio`` exists) while a real Prometheus
(``tests/promserver.py``, 1 s scrapes) scrapes it. The dashboards' variables are resolved through the
Prometheus API the way Grafana resolves them (``label_values(selector, label)`` → ``/api/v1/label/…``
with ``match[]``, earlier variables substituted, natural sort, the first value; ``query_result(expr)``
→ an instant query, each series as Grafana's text ``{labels} value timestamp`` through the variable's
regex, in the query's order; a custom variable's current value), ``$__rate_interval`` and ``$__interval``
are replaced by what Grafana would use for 1 s scrapes, and each target's query must return at least one
series. A second pass selects "All" for every variable (Grafana's ``(v1|v2|…)`` regex). The shipped rules
are loaded, with one extra alert that always fires, so the alerts table and annotation read real
``ALERTS`` series; every annotation's query must run too (it may be empty: no spike in a healthy run).

Skipped without the ``prometheus`` binary, except under ``STREAMWATCH_REQUIRE_PROMETHEUS=1``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw
from tests.promserver import PrometheusServer, require_prometheus
from tests.test_dashboards import exprs, load_generator

# Panels that are empty by design in a healthy run. Everything else must return data. Queries for events
# that are 0 when healthy are written to return 0 rather than nothing (`> bool 0`, rates of counters that
# exist from the start), so they are not listed here.
EMPTY_WHEN_HEALTHY = {
    # streamwatch_tensors_skipped_total has no series until the first tensor is skipped
    ("streamwatch-health.json", "Tensors skipped by reason"),
}

RATE_INTERVAL = "4s"  # Grafana: max(4 × scrape interval, $__interval) with 1 s scrapes
INTERVAL = "1s"
DATA_TIMEOUT_S = 75.0
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<selector>.*),\s*)?(?P<label>\w+)\)$")
QUERY_RESULT = re.compile(r"^query_result\((?P<expr>.*)\)$", re.DOTALL)
RULES = Path(__file__).resolve().parents[1] / "dashboards" / "rules" / "streamwatch.rules.yml"
ALWAYS_FIRING = """groups:
  - name: dashboards-e2e
    rules:
      - alert: StreamwatchE2EAlwaysFiring
        expr: streamwatch_info
        labels:
          severity: none
"""


class Backend(Protocol):
    """What the dashboards read: Prometheus' query API (a Prometheus server, or VictoriaMetrics')."""

    def query(self, promql: str, time: float | None = None) -> list[dict[str, Any]]: ...

    def label_values(self, label: str, match: str | None = None) -> list[str]: ...


VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def _natural_key(value: str) -> list[Any]:
    """Grafana's natural sort (``sort: 7``): digits compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", value)]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana's built-in intervals and the dashboard variables in ``expr``."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", INTERVAL)

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise AssertionError(f"unresolved variable ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(one, expr)


def _grafana_text(series: dict[str, Any]) -> str:
    """An instant-query series as Grafana's ``query_result`` writes it: ``name{labels} value timestamp``."""
    labels = dict(series["metric"])
    name = labels.pop("__name__", "")
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    timestamp, value = series["value"]
    return f"{name}{{{body}}} {value} {int(float(timestamp) * 1000)}"


def _variable_values(prom: Backend, variable: dict[str, Any], values: dict[str, str]) -> list[str]:
    """A query variable's options as Grafana lists them."""
    match = LABEL_VALUES.match(variable["query"])
    if match:
        selector = match["selector"]
        if selector is not None:
            selector = substitute(selector, values)
        return sorted(prom.label_values(match["label"], selector), key=_natural_key)
    match = QUERY_RESULT.match(variable["query"])
    assert match, variable["query"]
    regex = re.compile(variable["regex"].strip("/"))
    found: list[str] = []
    for series in prom.query(substitute(match["expr"], values)):
        hit = regex.search(_grafana_text(series))
        if hit and hit.group(1) not in found:
            found.append(hit.group(1))
    assert variable["sort"] == 0  # in the query's order: topk's, the worst first
    return found


def resolve_variables(
    prom: Backend, model: dict[str, Any], pick: Callable[[list[str]], str]
) -> dict[str, str]:
    """The dashboard's variables, in order, each resolved through the Prometheus API as Grafana does.

    ``pick`` turns the values of a query variable into its substituted text; a custom variable takes its
    current value.
    """
    values: dict[str, str] = {}
    for variable in model["templating"]["list"]:
        if variable["type"] == "custom":
            values[variable["name"]] = variable["current"]["value"]
            continue
        if variable["type"] != "query":
            continue
        found = _variable_values(prom, variable, values)
        assert found, f"variable ${variable['name']} has no values ({variable['query']})"
        values[variable["name"]] = pick(found)
    return values


def first(found: list[str]) -> str:
    """The first value, regex-escaped as Grafana escapes a value used with ``=~``."""
    return re.escape(found[0])


def all_values(found: list[str]) -> str:
    """Grafana's "All" of a multi-value variable without ``allValue``: ``(v1|v2|…)``."""
    return "(" + "|".join(re.escape(v) for v in found) + ")"


def resolved_queries(
    prom: Backend, dashboards: dict[str, dict[str, Any]], pick: Callable[[list[str]], str]
) -> list[tuple[str, str, str, bool]]:
    """``(dashboard, panel or annotation title, query, data required)`` of every target and annotation,
    with the variables resolved through ``prom``."""
    out = []
    for name, model in dashboards.items():
        values = resolve_variables(prom, model, pick)
        for title, target in exprs(model):
            out.append(
                (name, title, substitute(target["expr"], values), (name, title) not in EMPTY_WHEN_HEALTHY)
            )
        for annotation in model["annotations"]["list"]:
            if "target" in annotation:
                out.append(
                    (name, annotation["name"], substitute(annotation["target"]["expr"], values), False)
                )
    return out


def empty_targets(
    prom: Backend, dashboards: dict[str, dict[str, Any]], pick: Callable[[list[str]], str]
) -> list[str]:
    """``dashboard: panel: query`` of every target that returns nothing (allow-listed panels excepted), or
    the variable that has no value yet (the first sampled step may not have been scraped)."""
    try:
        queries = resolved_queries(prom, dashboards, pick)
    except AssertionError as err:
        return [str(err)]
    missing = []
    for name, title, query, required in queries:
        result = prom.query(query)  # raises on a query Prometheus rejects, allow-listed or not
        if not result and required:
            missing.append(f"{name}: {title}: {query}")
    return missing


def test_every_panel_query_returns_data_from_a_real_training_run(tmp_path: Path) -> None:
    require_prometheus()
    generator = load_generator()
    dashboards = {name: generator.build(name) for name in generator.DASHBOARDS}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    metrics = [*sw.DEFAULT_METRICS, sw.metrics.Histogram(kinds=("param_grad",))]
    # overhead=: the governor picks the sampled steps, and serves the measured overhead the health
    # dashboard plots (a fixed every= serves no streamwatch_overhead_ratio)
    with sw.observe(model, opt, metrics=metrics, overhead=0.05) as watch:
        exporter = watch.expose(port=0, run="dash")
        always = tmp_path / "always.rules.yml"
        always.write_text(ALWAYS_FIRING, encoding="utf-8")
        rules = [RULES, always]
        with PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{exporter.port}"], rule_files=rules) as prom:

            def train(steps: int) -> None:
                for _ in range(steps):
                    x, y = torch.randn(32, 10, generator=g), torch.randint(0, 4, (32,), generator=g)
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    watch.step(loss=loss, outputs=out, targets=y, batch_size=32)
                    time.sleep(0.01)  # spread the steps over the scrapes, as a real run would

            deadline = time.monotonic() + DATA_TIMEOUT_S
            train(20)
            prom.wait_for('up{job="streamwatch"} == 1', timeout=30)
            missing: list[str] = ["(not checked yet)"]
            while time.monotonic() < deadline:
                train(20)
                missing = empty_targets(prom, dashboards, first)
                if not missing:
                    break
            assert missing == [], "queries without data:\n" + "\n".join(missing)
            # every variable at "All": the queries still run and still return data
            train(20)
            assert empty_targets(prom, dashboards, all_values) == []
