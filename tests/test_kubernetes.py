"""The Kubernetes bundle in ``dashboards/kubernetes/``: generated from the same sources as the dashboards
and rules (``dashboards/generate.py`` with ``dashboards/k8s_bundle.py``; ``test_dashboards.py`` checks
the committed files equal the generator's), parsed here with PyYAML and checked field by field:

* the PodMonitor selects the labelled pods, one endpoint per local rank on the default ports' names,
  ``job`` relabelled to ``streamwatch`` (what the rules and dashboards select);
* the PrometheusRule's ``spec.groups`` is exactly the rules file's ``groups``, and promtool accepts them;
* one ConfigMap per dashboard, labelled ``grafana_dashboard: "1"`` for the Grafana sidecar, whose data is
  exactly the committed dashboard JSON, small enough for ``kubectl apply``;
* the kustomization lists the three.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamwatch.sinks import DEFAULT_PORT
from tests.test_dashboards import DASHBOARD_NAMES

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "dashboards" / "kubernetes"
RULES = ROOT / "dashboards" / "rules" / "streamwatch.rules.yml"


def _docs(name: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((BUNDLE / name).read_text(encoding="utf-8")) if d is not None]
    assert docs, name
    return docs


def test_the_podmonitor_scrapes_every_local_rank_as_job_streamwatch() -> None:
    (monitor,) = _docs("podmonitor.yaml")
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    spec = monitor["spec"]
    assert spec["selector"] == {"matchLabels": {"streamwatch.io/scrape": "true"}}
    assert spec["namespaceSelector"] == {"any": True}
    endpoints = spec["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [f"sw-rank-{r}" for r in range(len(endpoints))]
    assert len(endpoints) == 8
    for endpoint in endpoints:
        assert endpoint["path"] == "/metrics"
        assert endpoint["relabelings"] == [{"targetLabel": "job", "replacement": "streamwatch"}]
        assert re.fullmatch(r"\d+s", endpoint["interval"])
    # the container ports it documents are streamwatch's: the default base port + local rank
    text = (BUNDLE / "podmonitor.yaml").read_text(encoding="utf-8")
    documented = [int(p) for p in re.findall(r"containerPort: (\d+)", text)]
    assert documented == [DEFAULT_PORT + r for r in range(len(endpoints))]


def test_the_prometheusrule_holds_exactly_the_rules_and_promtool_accepts_them(tmp_path: Path) -> None:
    (rule,) = _docs("prometheusrule.yaml")
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert rule["metadata"]["name"] == "streamwatch"
    shipped = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    assert rule["spec"] == {"groups": shipped["groups"]}
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) == RULES.read_text(encoding="utf-8").count("- alert: ")
    assert all(a["annotations"]["runbook_url"].startswith("docs/runbooks.md#") for a in alerts)
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (the Debian package prometheus)")
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps(rule["spec"]), encoding="utf-8")  # JSON is valid YAML
    check = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_one_configmap_per_dashboard_for_the_grafana_sidecar() -> None:
    maps = _docs("dashboards.yaml")
    assert sorted(m["data"] and next(iter(m["data"])) for m in maps) == DASHBOARD_NAMES
    for config in maps:
        assert (config["apiVersion"], config["kind"]) == ("v1", "ConfigMap")
        assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config["metadata"]["annotations"]["grafana_folder"] == "streamwatch"
        ((filename, text),) = config["data"].items()
        assert config["metadata"]["name"] == filename.removesuffix(".json")
        committed = (ROOT / "dashboards" / filename).read_text(encoding="utf-8")
        assert json.loads(text) == json.loads(committed)
        # client-side kubectl apply keeps the object in an annotation of at most 256 KiB
        assert len(json.dumps(config).encode()) < 256 * 1024, filename


def test_the_kustomization_lists_the_bundle() -> None:
    (kustomization,) = _docs("kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == ["dashboards.yaml", "podmonitor.yaml", "prometheusrule.yaml"]
    for resource in kustomization["resources"]:
        assert (BUNDLE / resource).is_file()
