"""docs/helm.md stays true: its Argo CD Application and Flux HelmRelease point at the
chart and carry values the chart's schema accepts, its scrape config copies the
pod label the operator really puts on engine pods, and its KEDA recipe scales the
InferenceDeployment it shows (metricsCompat: vllm) with PromQL that parses."""

from __future__ import annotations

import re

import yaml

from chart_helpers import CHART, helm, one
from harness import docs as doc_pages

REPO = CHART.parents[1]
DOC = REPO / "docs" / "helm.md"


def yaml_documents() -> list[dict]:
    return doc_pages.yaml_documents(DOC)


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


# ---- docs/operations.md --------------------------------------------------------------------

OPERATIONS = REPO / "docs" / "operations.md"


def _table_rows(heading_text: str) -> dict[str, str]:
    """{field: default} of the first markdown table after the line containing heading_text."""
    text = OPERATIONS.read_text()
    after = text[text.index(heading_text):]
    rows = {}
    for line in after.splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        match = re.match(r"\| `([^`]+)` \| `([^`]+)` \|", line)
        if match:
            rows[match.group(1)] = match.group(2)
    assert rows, f"no table after {heading_text!r}"
    return rows


def _wire_default(wire: dict, dotted: str):
    value = wire
    for part in dotted.split("."):
        value = value[part]
    return value


def test_operations_tables_state_the_model_defaults():
    from shapeshift.operator.api import CompilationPolicy, DriftThresholds, RolloutSpec

    compilation = _table_rows("`spec.compilation` of the InferenceDeployment")
    # drift has no default object (it is required by OnDrift only): its fields' defaults
    wire = {**CompilationPolicy().to_wire(), "drift": DriftThresholds().to_wire()}
    for field, default in compilation.items():
        assert str(_wire_default(wire, field)) == default, (field, default)
    rollout = _table_rows("`spec.rollout`:")
    for field, default in rollout.items():
        assert str(_wire_default(RolloutSpec().to_wire(), field)) == default, (field, default)
    assert set(rollout) == set(RolloutSpec().to_wire()), "every rollout field is documented"


def test_operations_artifact_store_example_is_a_valid_spec_and_mounts_where_it_says():
    from shapeshift.operator import builders
    from shapeshift.operator.api import ARTIFACT_MOUNT, InferenceDeploymentSpec

    blocks = [yaml.safe_load(b) for b in doc_pages.yaml_blocks(OPERATIONS)]
    fragment = next(b["spec"] for b in blocks if "artifacts" in (b or {}).get("spec", {}))
    spec = InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"},
                                                   "hardware": {"accelerator": "cpu"}, **fragment})
    assert f"`{ARTIFACT_MOUNT}`" in OPERATIONS.read_text()
    engine = builders.build_engine_deployment(builders.Parent("InferenceDeployment", "chat", "ns", "uid"), spec)
    mounts = engine["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "artifacts", "mountPath": ARTIFACT_MOUNT, "subPath": "chat", "readOnly": True} in mounts


CONDITION_TYPES = {"Ready", "ChildrenApplied", "PodsCreated", "PodsHealthy", "Scheduled", "TrafficObserved",
                   "Drifted", "Regime", "ForwardPassRolledOut", "DeploymentFound", "Complete", "Failed", "PodFailed"}


def _condition_tables() -> str:
    text = OPERATIONS.read_text()
    starts = [m.start() for m in re.finditer(r"\| condition \| reasons \|", text)]
    assert len(starts) == 2, "the InferenceDeployment and CompileRun conditions tables"
    return "\n".join(text[i:].split("\n\n")[0] for i in starts)


def _operator_source() -> str:
    return "\n".join(p.read_text() for p in (REPO / "operator").rglob("*.py"))


def test_operations_names_only_reasons_the_operator_writes():
    """Every CamelCase reason in the conditions tables is a string the operator's code writes."""
    source = _operator_source()
    job_controllers = {"BackoffLimitExceeded", "DeadlineExceeded"}  # the Job's own reasons, passed through
    reasons = (set(re.findall(r"`([A-Z][A-Za-z]+)`", _condition_tables())) - CONDITION_TYPES - job_controllers
               - {"Unknown", "False"})
    assert len(reasons) > 30, reasons
    missing = sorted(r for r in reasons if f'"{r}"' not in source)
    assert not missing, f"docs/operations.md names reasons the operator never writes: {missing}"


def test_operations_lists_every_condition_and_reason_the_operator_writes():
    """The other way round: each condition type and literal reason of a condition the operator writes
    (a ("Type", "True|False|Unknown", "Reason", ...) tuple, and the reason tables of the drift,
    regime and rollout code) is in the conditions tables."""
    from shapeshift.operator import drift_check, rollout_target, rollout_tick

    source = _operator_source()
    written = set(re.findall(r'\(\s*"([A-Z][A-Za-z]+)",\s*"(?:True|False|Unknown)",\s*"([A-Z][A-Za-z]+)"', source))
    types = {t for t, _ in written} | {drift_check.CONDITION_TRAFFIC, drift_check.CONDITION_DRIFT,
                                       drift_check.CONDITION_REGIME, rollout_tick.CONDITION, "ChildrenApplied"}
    reasons = ({r for _, r in written} | set(drift_check.REGIME_REASONS.values()) | set(drift_check.TRAFFIC_REASONS)
               | set(rollout_tick.EVENT_REASONS.values()) | set(rollout_target.REJECTION_REASONS)
               | {"Applied", "ChildRefused", "NoBaseline", "PrometheusUnavailable"})
    tables = _condition_tables()
    assert types <= CONDITION_TYPES
    missing = sorted(name for name in types | reasons if f"`{name}`" not in tables)
    assert not missing, f"conditions or reasons the operator writes that docs/operations.md does not list: {missing}"


def test_helm_page_lists_every_chart_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    whole = {"resources", "podSecurityContext", "securityContext"}  # documented as one value each

    def leaves(node, prefix=""):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict) and value and key not in whole:
                yield from leaves(value, path + ".")
            else:
                yield path

    text = DOC.read_text()
    missing = [key for key in leaves(values) if f"`{key}`" not in text]
    assert not missing, f"chart values docs/helm.md does not describe: {missing}"


def test_vllm_metrics_deployment_passes_the_flag_to_the_engine():
    from shapeshift.operator.api import InferenceDeploymentSpec
    from shapeshift.operator.builders import Parent, build_engine_deployment

    idep = next(d for d in yaml_documents() if d.get("kind") == "InferenceDeployment")
    spec = InferenceDeploymentSpec.model_validate(idep["spec"])
    parent = Parent("InferenceDeployment", idep["metadata"]["name"], idep["metadata"]["namespace"], "uid")
    (container,) = build_engine_deployment(parent, spec)["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--metrics-compat") + 1] == "vllm"


def test_keda_recipe_scales_the_inference_deployment_and_its_queries_parse(tmp_path):
    """The ScaledObject targets the InferenceDeployment (the CRD's scale subresource) the page
    declares, selects by the target labels the scrape config writes, and its PromQL parses."""
    import shutil
    import subprocess

    from harness import tools

    docs = yaml_documents()
    idep = next(d for d in docs if d.get("kind") == "InferenceDeployment")
    scaled = next(d for d in docs if d.get("kind") == "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "shapeshift.dev/v1alpha1",
                                               "kind": "InferenceDeployment", "name": idep["metadata"]["name"]}
    assert scaled["metadata"]["namespace"] == idep["metadata"]["namespace"]
    crd = yaml.safe_load((REPO / "crds" / "shapeshift.dev_inferencedeployments.yaml").read_text())
    assert crd["spec"]["versions"][0]["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    selector = f'namespace="{idep["metadata"]["namespace"]}",deployment="{idep["metadata"]["name"]}"'
    for query in queries:
        assert query.count("{") == query.count(selector), query
    promtool = shutil.which("promtool", path=str(tools.prometheus().resolve().parent))
    assert promtool, "promtool not found next to prometheus; it ships in Debian's prometheus package"
    rules = [{"record": f"keda:query_{i}", "expr": q} for i, q in enumerate(queries)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "keda", "rules": rules}]}))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout
