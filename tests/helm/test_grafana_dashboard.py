"""The chart's Grafana dashboard (templates/grafana-dashboard.yaml, dashboards/shapeshift-engine.json)
through the real helm binary: off by default, a ConfigMap with the sidecar's label when enabled,
JSON that parses, PromQL that promtool accepts, and queries that name only series the engine
exports (engine/contracts/metric_names.py, typed by the engine's own registry), select by the
target labels the chart's prometheus.*Label values name, and return data from a real engine
scraped by a real Prometheus."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from chart_helpers import by_kind, one, render
from harness import tools

DATA_KEY = "shapeshift-engine.json"

# PromQL words that are not series names: functions are followed by "(" and dropped separately.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def exported_series() -> set[str]:
    """Every series name the engine's /metrics can carry, from the names in metric_names.py,
    expanded by the type the engine's registry gives each (histogram -> _bucket/_sum/_count)."""
    from shapeshift.engine.contracts import metric_names
    from shapeshift.engine.serving.metrics import EngineMetrics

    contract = {value for key, value in vars(metric_names).items()
                if key.isupper() and isinstance(value, str) and value.startswith(metric_names.PREFIX)
                and value != metric_names.PREFIX}
    series: set[str] = set()
    for family in EngineMetrics("m").registry.collect():
        if family.type == "histogram":
            assert family.name in contract, family.name
            series |= {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        else:
            full = family.name + {"counter": "_total", "info": "_info"}.get(family.type, "")
            assert full in contract, f"the engine exports {full}, which metric_names.py does not name"
            series.add(full)
    return series


def dashboard(values: dict[str, str] | None = None) -> tuple[dict, dict]:
    objects = render({"grafanaDashboard.enabled": "true", **(values or {})})
    config_map = one(objects, "ConfigMap", "-grafana-dashboard")
    return config_map, json.loads(config_map["data"][DATA_KEY])


def expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return exprs


def series_names(expr: str) -> set[str]:
    """The series an expression selects: strings, label matchers, ranges, grouping clauses,
    Grafana variables and function names removed, what is left that looks like a name."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    text = re.sub(r"\b[a-zA-Z_]\w*\s*\(", "(", text)  # functions and aggregations
    text = re.sub(r",\s*[a-zA-Z_]\w*\s*\)", ")", text)  # label_values(series, label): the label
    return {w for w in re.findall(r"(?<![\w.])[a-zA-Z_:][\w:]*", text) if w not in KEYWORDS}


def selector_labels(expr: str) -> set[str]:
    """Label names in matchers ({label=~"..."}) and grouping clauses (by (a, b))."""
    labels = {m for body in re.findall(r"\{([^}]*)\}", expr) for m in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body)}
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    labels |= set(re.findall(r"label_values\([^)]*?,\s*(\w+)\)", expr))
    return labels


def test_not_rendered_by_default():
    assert not [o for o in by_kind(render(), "ConfigMap") if o["metadata"]["name"].endswith("-grafana-dashboard")]


def test_enabled_renders_a_configmap_with_the_sidecar_label():
    config_map, board = dashboard()
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "shapeshift-system"
    assert "annotations" not in config_map["metadata"]
    assert board["uid"] == "shapeshift-engine" and board["panels"]
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "namespace", "deployment", "model", "pod"}

    config_map, _ = dashboard({"grafanaDashboard.label": "dashboards", "grafanaDashboard.labelValue": "shapeshift",
                               "grafanaDashboard.namespace": "monitoring",
                               "grafanaDashboard.annotations": '{"grafana_folder":"Shapeshift"}'})
    labels = config_map["metadata"]["labels"]
    assert labels["dashboards"] == "shapeshift" and "grafana_dashboard" not in labels
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Shapeshift"}


def test_every_query_names_only_series_the_engine_exports():
    known = exported_series()
    _, board = dashboard()
    used: set[str] = set()
    for expr in expressions(board):
        names = series_names(expr)
        assert names, f"no series found in {expr!r}"
        assert names <= known, f"{expr!r} names {sorted(names - known)}, which the engine does not export"
        used |= names
    # the panels the dashboard exists for
    for needed in ("shapeshift_generated_tokens_total", "shapeshift_time_to_first_token_seconds_bucket",
                   "shapeshift_inter_token_latency_seconds_bucket", "shapeshift_kv_cache_usage_ratio",
                   "shapeshift_preemptions_total", "shapeshift_requests_waiting",
                   "shapeshift_prefix_cache_hits_tokens_total", "shapeshift_forward_pass_info"):
        assert needed in used, needed


def test_the_series_check_can_fail():
    assert series_names('sum by (pod) (rate(vllm:num_preemptions_total{pod=~"$pod"}[$__rate_interval]))') == {
        "vllm:num_preemptions_total"}
    assert series_names("histogram_quantile(0.9, sum by (le) (rate(shapeshift_ttft_bucket{a=\"b\"}[5m])))") == {
        "shapeshift_ttft_bucket"}
    assert "shapeshift_ttft_bucket" not in exported_series()


def test_queries_select_by_the_configured_target_labels():
    _, board = dashboard({"prometheus.namespaceLabel": "kubernetes_namespace",
                          "prometheus.deploymentLabel": "shapeshift_deployment", "prometheus.podLabel": "kubernetes_pod"})
    allowed = {"kubernetes_namespace", "shapeshift_deployment", "kubernetes_pod", "model", "le", "status", "result",
               "name", "sha256"}
    for expr in expressions(board):
        assert selector_labels(expr) <= allowed, f"{expr!r} selects by {sorted(selector_labels(expr) - allowed)}"
    legends = {t["legendFormat"] for p in board["panels"] for t in p.get("targets", [])}
    assert "{{kubernetes_pod}}" in legends and not any("{{pod}}" in legend for legend in legends)


def test_promtool_parses_every_query(tmp_path):
    """Each expression, Grafana's variables given values, as a recording rule: `promtool check
    rules` parses the PromQL."""
    promtool = shutil.which("promtool", path=str(tools.prometheus().resolve().parent))
    if promtool is None:
        pytest.fail("promtool not found next to prometheus; it ships in Debian's prometheus package")
    _, board = dashboard()
    rules = []
    for i, expr in enumerate(t["expr"] for p in board["panels"] for t in p.get("targets", [])):
        expr = expr.replace("$__rate_interval", "1m")
        expr = re.sub(r"\$\{?(\w+)\}?", ".*", expr)
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


# Queries that have data only after a forward-pass reload, which a fresh engine has not had.
NEEDS_A_RELOAD = ("shapeshift_forward_pass_reloads_total", "shapeshift_forward_pass_last_reload_status",
                  "shapeshift_forward_pass_last_reload_timestamp_seconds")


def test_every_panel_has_data_from_a_real_engine(prometheus, tmp_path):
    """A real `shapeshift serve` (tiny-llama, CPU) scraped by a real Prometheus with the target
    labels a ServiceMonitor writes, a few requests, then every panel query, Grafana's variables at
    "All": each returns series, except the reload panels (no reload has happened)."""
    from harness.engine_server import ServerProcess, complete

    server = ServerProcess([], tmp_path / "engine.log").start()
    try:
        target = server.base_url.removeprefix("http://")
        prom = prometheus([{"job_name": "engines", "scrape_interval": "1s", "scrape_timeout": "1s",
                            "static_configs": [{"targets": [target], "labels": {
                                "namespace": "team-a", "deployment": "chat", "pod": "chat-engine-0"}}]}])
        prom.wait_for("count(shapeshift_forward_pass_info)", timeout_s=30)
        for i in range(4):
            assert complete(server.base_url, f"the dashboard request {i}", max_tokens=4).status_code == 200
        prom.wait_for('sum(shapeshift_requests_total{status=~"stop|length"})', lambda v: v >= 4, timeout_s=30)
        prom.wait_for("count_over_time(shapeshift_requests_running[1m])", lambda v: v >= 3, timeout_s=30)
        _, board = dashboard()
        empty, checked = [], 0
        for panel in board["panels"]:
            for target_ in panel.get("targets", []):
                expr = target_["expr"].replace("$__rate_interval", "1m")
                expr = re.sub(r"\$\{?(\w+)\}?", ".*", expr)
                if any(name in expr for name in NEEDS_A_RELOAD):
                    continue
                checked += 1
                if not prom.query(expr):
                    empty.append(f"{panel['title']}: {expr}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        assert checked >= 20
        # the variables' label_values(series, label): the series carry the label
        for variable in (v for v in board["templating"]["list"] if v["type"] == "query"):
            series, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"]).groups()
            found = prom.api("series", **{"match[]": re.sub(r"\$\{?(\w+)\}?", ".*", series)})
            assert found and all(label in s for s in found), (variable["name"], found)
    finally:
        server.stop()
