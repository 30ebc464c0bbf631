"""docs/helm.md stays true: its Argo CD Application and Flux HelmRelease point at the
chart and carry values the chart's schema accepts, and its scrape config copies the
pod label the operator really puts on engine pods."""

from __future__ import annotations

import re

import yaml

from chart_helpers import CHART, helm, one

REPO = CHART.parents[1]
DOC = REPO / "docs" / "helm.md"


def yaml_documents() -> list[dict]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def render_with(values: dict, tmp_path) -> list[dict]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    text = helm("template", "shapeshift", str(CHART), "--namespace", "shapeshift-system", "-f", str(path)).stdout
    return [d for d in yaml.safe_load_all(text) if d]


def test_argo_cd_application_values_render(tmp_path):
    app = next(d for d in yaml_documents() if d.get("kind") == "Application")
    source = app["spec"]["source"]
    assert (REPO / source["path"] / "Chart.yaml").exists()
    objects = render_with(source["helm"]["valuesObject"], tmp_path)
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/shapeshift/operator:0.1.0"
    assert one(objects, "ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_flux_helm_release_values_render(tmp_path):
    docs = yaml_documents()
    release = next(d for d in docs if d.get("kind") == "HelmRelease")
    source = next(d for d in docs if d.get("kind") == "GitRepository")
    assert release["spec"]["chart"]["spec"]["sourceRef"] == {"kind": "GitRepository", "name": source["metadata"]["name"]}
    assert (REPO / release["spec"]["chart"]["spec"]["chart"] / "Chart.yaml").exists()
    assert release["spec"]["install"]["crds"] == release["spec"]["upgrade"]["crds"] == "CreateReplace"
    objects = render_with(release["spec"]["values"], tmp_path)
    assert one(objects, "Deployment")


def test_scrape_config_copies_the_engine_pod_label():
    from shapeshift.operator.builders import LABEL_DEPLOYMENT, engine_labels

    config = next(d for d in yaml_documents() if "scrape_configs" in d)
    relabels = config["scrape_configs"][0]["relabel_configs"]
    meta_label = "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", LABEL_DEPLOYMENT)
    assert {"source_labels": [meta_label], "target_label": "deployment"} in relabels
    assert LABEL_DEPLOYMENT in engine_labels("x")


def test_scrape_config_is_a_valid_prometheus_config(tmp_path):
    """promtool (from Debian's prometheus package, next to the prometheus binary) checks it.

    Debian builds Prometheus without the Kubernetes service discovery, so the copy checked
    here swaps kubernetes_sd_configs for a static target; the relabelling rules, the part
    this document adds, are checked as written."""
    import shutil
    import subprocess

    from harness import tools

    promtool = shutil.which("promtool", path=str(tools.prometheus().resolve().parent))
    assert promtool, "promtool not found next to prometheus; it ships in Debian's prometheus package"
    config = next(d for d in yaml_documents() if "scrape_configs" in d)
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
