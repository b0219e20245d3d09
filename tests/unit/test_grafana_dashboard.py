"""deploy/grafana/kiln.json asks only for metrics kiln exports, by labels they have: the names
come from the prometheus_client metrics the code defines (every module under services/ that
imports prometheus_client is imported, then the default registry is read), with the suffixes
the exposition adds (_total, _bucket, _sum, _count, _created)."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "kiln.json"
SCRAPE_LABELS = {"instance", "job", "pod", "namespace", "le"}
"""Labels Prometheus adds when it scrapes (and a histogram's bucket bound)."""
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}
KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}


def exported() -> dict[str, set[str]]:
    """Every series name the services' /metrics may serve -> the metric's label names."""
    root = REPO / "services"
    for path in root.rglob("*.py"):
        if "prometheus_client" in path.read_text(errors="replace"):
            importlib.import_module(".".join(path.relative_to(root).with_suffix("").parts))
    labels: dict[str, set[str]] = {}
    registry: Any = prometheus_client.REGISTRY
    for collector in set(registry._collector_to_names):
        label_names = set(getattr(collector, "_labelnames", ()))
        for family in collector.collect():
            for suffix in SUFFIXES.get(family.type, ("",)):
                labels[family.name + suffix] = label_names
            for sample in family.samples:  # the process/platform/gc collectors' own series
                labels.setdefault(sample.name, set(sample.labels))
    return labels


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m[0].lower() in KEYWORDS:
            continue  # a function or an aggregation, not a series
        names.add(m[0])
    return names


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            query = query.get("query", "")
        if var["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query))
    return exprs


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_metric_names_are_read_from_the_code() -> None:
    names = exported()
    # The exposition's names of a counter, a histogram and a gauge the README lists.
    for name in (
        "kiln_rpc_requests_total",
        "kiln_ledger_append_seconds_bucket",
        "kiln_engine_work_queued",
    ):
        assert name in names
    assert "kiln_rpc_requests" not in names, "a counter is exported with _total"
    assert metric_names('sum by (tier) (rate(a_total{x="y"}[5m])) / on (le) b') == {"a_total", "b"}


def test_every_metric_the_dashboard_asks_for_is_exported(dashboard: dict[str, Any]) -> None:
    names = exported()
    used: set[str] = set()
    for expr in expressions(dashboard):
        for name in metric_names(expr):
            used.add(name)
            assert name in names, f"{name} is not exported by kiln (in {expr})"
            missing = grouping_labels(expr) - names[name] - SCRAPE_LABELS
            assert not missing, f"{name} has no label {sorted(missing)} (in {expr})"
    # The dashboard covers the engine pool, the ledger and every service's RPCs.
    for needed in (
        "kiln_engine_experiments_total",
        "kiln_engine_work_queued",
        "kiln_engine_experiment_device_seconds_sum",
        "kiln_ledger_append_seconds_bucket",
        "kiln_ledger_events_appended_total",
        "kiln_rpc_requests_total",
    ):
        assert needed in used, needed


def test_the_dashboard_is_well_formed(dashboard: dict[str, Any]) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"]
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in variables
    for p in dashboard["panels"]:
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), (p["title"], var)
    provisioning = REPO / "deploy" / "grafana" / "provisioning" / "dashboards" / "kiln.yaml"
    assert "path: /var/lib/grafana/dashboards/kiln" in provisioning.read_text()
