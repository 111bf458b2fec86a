"""The Prometheus rules in ``dashboards/rules``: syntax, unit tests, coverage, and a real server.

1. ``promtool check rules`` accepts ``streamwatch.rules.yml``.
2. ``promtool test rules`` passes ``tests/streamwatch_test.yml`` (recorded values and every alert).
3. Every alert in the rules file has a firing case (non-empty ``exp_alerts``) and a non-firing case
   (``exp_alerts: []``) in the test file, and carries ``for:``, a severity, a summary and a description.
   PyYAML is not a dependency, so both files are read by a small line parser of the layout they are
   written in (documented at the top of each); it fails loudly on anything it does not understand.
4. Fault injection: a real Prometheus loads the rules and scrapes a real training run; NaN gradients
   are injected and ``StreamwatchNonFiniteValues`` must reach ``firing`` in ``/api/v1/alerts``. The
   server loads a copy of the rules in which that alert's ``for: 1m`` (chosen to ride out the transient
   infs of mixed-precision loss scaling) is cut to 2 s, so the test waits seconds rather than a minute;
   every other line of the copy is the rules file as shipped.

``promtool`` and ``prometheus`` come with Debian's ``prometheus`` package: without them these tests skip,
except under ``STREAMWATCH_REQUIRE_PROMETHEUS=1`` (CI), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

import streamwatch as sw
from tests.promserver import MISSING_MESSAGE, REQUIRE_ENV, PrometheusServer, require_prometheus
from tests.training import Train

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "dashboards" / "rules" / "streamwatch.rules.yml"
RULE_TESTS = ROOT / "dashboards" / "rules" / "tests" / "streamwatch_test.yml"
ALERT = "StreamwatchNonFiniteValues"
PROMTOOL_TIMEOUT_S = 60.0


def require_promtool() -> str:
    """Return the ``promtool`` binary; skip without one, or fail if CI requires the Prometheus tools."""
    binary = shutil.which("promtool")
    if binary is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(MISSING_MESSAGE)
        pytest.skip(MISSING_MESSAGE)
    return binary


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``promtool`` with ``args`` from the repository root; return the finished process."""
    return subprocess.run(
        [require_promtool(), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=PROMTOOL_TIMEOUT_S,
        check=False,
    )


# -- a line parser for the two files' layout --------------------------------------------------------------

_ALERT_RE = re.compile(r"^\s*- alert:\s*(\S+)\s*$")
_RULE_START_RE = re.compile(r"^\s*- (alert|record):")
_ALERTNAME_RE = re.compile(r"^\s*(?:- )?alertname:\s*(\S+)\s*$")
_EXP_ALERTS_RE = re.compile(r"^\s*(?:- )?exp_alerts:\s*(.*?)\s*$")


def rule_blocks(text: str) -> dict[str, str]:
    """Each alerting rule's text (from its ``- alert:`` line to the next rule), keyed by alert name."""
    blocks: dict[str, str] = {}
    name: str | None = None
    for line in text.splitlines():
        if _RULE_START_RE.match(line) or line.lstrip().startswith("- name:"):
            name = None
        match = _ALERT_RE.match(line)
        if match:
            name = match.group(1)
            assert name not in blocks, f"alert {name} defined twice"
            blocks[name] = ""
        if name is not None:
            blocks[name] += line + "\n"
    return blocks


def alert_cases(text: str) -> dict[str, set[str]]:
    """The kinds of case (``firing``, ``not firing``) that the test file has for each alert name.

    In each ``alert_rule_test`` item ``alertname:`` comes before ``exp_alerts:``; ``exp_alerts: []`` is a
    non-firing case, ``exp_alerts:`` followed by ``- exp_labels:`` items a firing one.
    """
    lines = text.splitlines()
    cases: dict[str, set[str]] = {}
    current: str | None = None
    seen = 0
    for i, line in enumerate(lines):
        match = _ALERTNAME_RE.match(line)
        if match:
            assert current is None, f"line {i + 1}: alertname without exp_alerts before it"
            current = match.group(1)
            seen += 1
            continue
        match = _EXP_ALERTS_RE.match(line)
        if not match:
            continue
        assert current is not None, f"line {i + 1}: exp_alerts without an alertname before it"
        rest = match.group(1).split("#")[0].strip()
        if rest == "[]":
            kind = "not firing"
        else:
            following = next((ln for ln in lines[i + 1 :] if ln.strip()), "")
            assert rest == "", f"line {i + 1}: unexpected exp_alerts value {rest!r}"
            assert following.lstrip().startswith("- exp_labels:"), f"line {i + 2}: expected - exp_labels:"
            kind = "firing"
        cases.setdefault(current, set()).add(kind)
        current = None
    assert current is None, "the last alertname has no exp_alerts"
    uncommented = sum(1 for line in lines if "alertname:" in line.split("#")[0])
    assert seen == uncommented, f"{uncommented - seen} alertname lines not understood"
    return cases


# -- 1, 2: promtool ----------------------------------------------------------------------------------------


def test_promtool_check_rules_accepts_the_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


# -- 3: coverage -------------------------------------------------------------------------------------------


def test_every_alert_is_complete_and_has_a_firing_and_a_non_firing_case() -> None:
    blocks = rule_blocks(RULES.read_text(encoding="utf-8"))
    assert len(blocks) == 11, sorted(blocks)
    for name, block in blocks.items():
        assert name.startswith("Streamwatch"), name
        for key in ("expr:", "for:", "severity:", "summary:", "description:", "runbook_url:"):
            assert re.search(rf"^\s*{key}", block, re.MULTILINE), f"{name} has no {key}"
    cases = alert_cases(RULE_TESTS.read_text(encoding="utf-8"))
    assert set(cases) <= set(blocks), f"tests of unknown alerts: {sorted(set(cases) - set(blocks))}"
    missing = {
        name: sorted({"firing", "not firing"} - cases.get(name, set()))
        for name in blocks
        if cases.get(name) != {"firing", "not firing"}
    }
    assert not missing, f"alerts without a test case of that kind: {missing}"


def test_the_line_parsers_read_what_they_claim() -> None:
    rules = "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: x > 0\n        for: 1m\n"
    rules += "      - record: r\n        expr: y\n      - alert: B\n        expr: z\n"
    blocks = rule_blocks(rules)
    assert sorted(blocks) == ["A", "B"]
    assert "for: 1m" in blocks["A"]
    assert "record" not in blocks["A"]
    assert "for:" not in blocks["B"]
    tests = (
        "    alert_rule_test:\n      - eval_time: 1m\n        alertname: A\n        exp_alerts: []  # note\n"
        "      - eval_time: 2m\n        alertname: A\n        exp_alerts:\n          - exp_labels:\n"
        "              severity: x\n      - eval_time: 2m\n        alertname: B\n        exp_alerts: []\n"
    )
    assert alert_cases(tests) == {"A": {"firing", "not firing"}, "B": {"not firing"}}
    with pytest.raises(AssertionError, match="without an alertname"):
        alert_cases("        exp_alerts: []\n")


# -- 4: fault injection against a real Prometheus -----------------------------------------------------------


def rules_with_short_for(text: str, alert: str, duration: str) -> str:
    """``text`` with the ``for:`` of ``alert`` (and nothing else) set to ``duration``."""
    block = rule_blocks(text)[alert]
    shortened, count = re.subn(r"^(\s*for:\s*)\S+", rf"\g<1>{duration}", block, count=1, flags=re.MULTILINE)
    assert count == 1, f"{alert} has no for:"
    assert text.count(block) == 1
    return text.replace(block, shortened)


def alert_states(prom: PrometheusServer, alertname: str, run: str) -> list[str]:
    """The states (``pending``, ``firing``) of the active alerts named ``alertname`` for ``run``."""
    return [
        a["state"]
        for a in prom.alerts()
        if a["labels"].get("alertname") == alertname and a["labels"].get("run") == run
    ]


def test_injected_nans_fire_the_non_finite_alert_in_a_real_prometheus(tmp_path: Path, train: Train) -> None:
    require_prometheus()
    rules = tmp_path / "streamwatch.rules.yml"
    rules.write_text(rules_with_short_for(RULES.read_text(encoding="utf-8"), ALERT, "2s"), encoding="utf-8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)  # one stream of batches for both stretches of training

    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0, run="faults")
        with PrometheusServer(tmp_path / "prom", [f"127.0.0.1:{exporter.port}"], rule_files=[rules]) as prom:
            train(model, opt, watch, 12, shape=(16, 8), generator=g, flush=True)
            # healthy: the rules have evaluated over scraped data, and the alert is not even pending
            prom.wait_for('streamwatch_step{run="faults"} == 11', bool)
            prom.wait_for('streamwatch:grad_norm:global{run="faults"} > 0', bool)
            time.sleep(2.5)  # more evaluations than `for` lasts
            assert prom.query('streamwatch_tensor_nonfinite_elements{run="faults"}')
            assert not prom.query(f'ALERTS{{alertname="{ALERT}"}}')
            assert alert_states(prom, ALERT, "faults") == []
            with urllib.request.urlopen(f"{prom.url}/api/v1/rules", timeout=10.0) as resp:
                groups = json.load(resp)["data"]["groups"]
            health = {r["name"]: (r["health"], r.get("lastError", "")) for g in groups for r in g["rules"]}
            assert len(health) == 18, sorted(health)
            assert all(h == "ok" for h, _ in health.values()), health  # evaluated over real series, no error

            # the fault: every gradient of the first layer's weight becomes NaN from here on
            first = model[0]
            assert isinstance(first, nn.Linear)
            first.weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
            train(model, opt, watch, 4, shape=(16, 8), generator=g, flush=True)
            deadline = time.monotonic() + 30.0
            states = alert_states(prom, ALERT, "faults")
            while "firing" not in states:
                assert time.monotonic() < deadline, f"{ALERT} not firing in 30 s: {states}; {prom.alerts()}"
                time.sleep(0.2)
                states = alert_states(prom, ALERT, "faults")
            firing = [
                a for a in prom.alerts() if a["labels"].get("alertname") == ALERT and a["state"] == "firing"
            ]
            # one alert for the process, whatever the layers and kinds its NaNs spread to
            assert len(firing) == 1, firing
            for a in firing:
                assert a["labels"]["severity"] == "critical"
                assert a["labels"]["run"] == "faults"
                assert a["labels"]["rank"] == "0"
                assert "layer" not in a["labels"]
                assert "kind" not in a["labels"]
                assert float(a["value"]) > 0
                assert a["annotations"]["summary"] == "NaN/Inf in run faults, rank 0"
                assert a["annotations"]["runbook_url"] == "docs/runbooks.md#streamwatchnonfinitevalues"
                # the origin, from streamwatch_first_nonfinite_info: the NaN weight gradient of layer 0,
                # the first non-finite tensor of the first step that had one (watch.statistics() agrees)
                origin = a["annotations"]["origin"]
                assert origin.startswith(
                    "The run's first non-finite value: "
                    'param_grad of layer "0" (param weight), backward, step 12'
                ), a["annotations"]
            first_nonfinite = watch.statistics().first_nonfinite
            assert first_nonfinite is not None
            assert (first_nonfinite.step, first_nonfinite.layer, first_nonfinite.kind) == (
                12,
                "0",
                "param_grad",
            )


def test_a_missing_promtool_skips_or_fails_as_ci_requires(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="prometheus"):
        require_promtool()
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="prometheus"):
        require_promtool()


def test_every_runbook_url_leads_to_a_runbook_section_with_queries_and_causes() -> None:
    """Each alert's runbook_url is docs/runbooks.md#<alert in lower case>, a section (a heading named for
    the alert) that says what it means, the first queries to run (a promql block) and the likely causes."""
    runbooks = (ROOT / "docs" / "runbooks.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", runbooks, re.MULTILINE | re.DOTALL))
    for name, block in rule_blocks(RULES.read_text(encoding="utf-8")).items():
        url = re.search(r"^\s*runbook_url:\s*(\S+)\s*$", block, re.MULTILINE)
        assert url is not None, name
        assert url[1] == f"docs/runbooks.md#{name.lower()}", url[1]
        assert name in sections, f"docs/runbooks.md has no section ## {name}"
        section = sections[name]
        for part in ("**What it means.**", "**First queries.**", "**Likely causes.**"):
            assert part in section, f"{name}: no {part}"
        assert "```promql" in section, f"{name}: no queries"


def test_the_alertmanager_example_groups_by_run_and_routes_every_severity() -> None:
    """dashboards/alertmanager.yml: one notification per alert and run (group_by), critical alerts paged,
    every receiver it names defined, and the inhibited alerts exist in the rules."""
    config = yaml.safe_load((ROOT / "dashboards" / "alertmanager.yml").read_text(encoding="utf-8"))
    route = config["route"]
    assert route["group_by"] == ["alertname", "job", "run"]
    receivers = {r["name"] for r in config["receivers"]}
    assert route["receiver"] in receivers
    assert {r["receiver"] for r in route["routes"]} <= receivers
    assert any(r["matchers"] == ['severity="critical"'] for r in route["routes"])
    alerts = set(rule_blocks(RULES.read_text(encoding="utf-8")))
    for rule in config["inhibit_rules"]:
        named = re.findall(r"Streamwatch\w+", " ".join(rule["source_matchers"] + rule["target_matchers"]))
        assert set(named) <= alerts, named
    runbooks = (ROOT / "docs" / "runbooks.md").read_text(encoding="utf-8")
    assert "group_by: [alertname, job, run]" in runbooks
