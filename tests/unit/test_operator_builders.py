"""Pure builders: names, owner references, placement, probes, the compile Job and its RBAC."""

from __future__ import annotations

import copy

import yaml

from shapeshift.operator import builders
from shapeshift.operator.builders import Parent
from shapeshift.operator.api import CompileRunSpec, InferenceDeploymentSpec

IDEP = Parent("InferenceDeployment", "llama", "prod", "uid-idep")
RUN = Parent("CompileRun", "llama-drift-1", "prod", "uid-run")


def spec(**over) -> InferenceDeploymentSpec:
    base = {"model": {"preset": "llama-3.2-1b-shape"}, "hardware": {"accelerator": "nvidia-h200", "count": 2},
            "replicas": 3}
    base.update(over)
    return InferenceDeploymentSpec.model_validate(base)


def run_spec(**over) -> CompileRunSpec:
    base = {"deploymentRef": {"name": "llama"}, "budget": {"wallClockSeconds": 1800, "trials": 200}}
    base.update(over)
    return CompileRunSpec.model_validate(base)


def owner_ok(obj, parent):
    (ref,) = obj["metadata"]["ownerReferences"]
    assert ref == {"apiVersion": "shapeshift.dev/v1alpha1", "kind": parent.kind, "name": parent.name,
                   "uid": parent.uid, "controller": True, "blockOwnerDeletion": True}
    assert obj["metadata"]["namespace"] == parent.namespace


def test_engine_deployment_for_h200():
    d = builders.build_engine_deployment(IDEP, spec())
    owner_ok(d, IDEP)
    assert d["metadata"]["name"] == "llama-engine" and d["spec"]["replicas"] == 3
    pod = d["spec"]["template"]
    assert d["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (c,) = pod["spec"]["containers"]
    assert c["resources"] == {"requests": {"nvidia.com/gpu": "2"}, "limits": {"nvidia.com/gpu": "2"}}
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "8000"
    assert ann["prometheus.io/path"] == "/metrics"
    assert c["command"] == ["shapeshift"] and c["args"][:3] == ["serve", "--model", "llama-3.2-1b-shape"]
    assert c["args"][c["args"].index("--device") + 1] == "cuda"
    assert "--enforce-eager" not in c["args"]


def test_trainium_and_cpu_placement():
    t = builders.build_engine_deployment(IDEP, spec(hardware={"accelerator": "trainium2", "count": 4}))
    pod = t["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"aws.amazon.com/neuron": "4"}
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn2.48xlarge"}
    assert pod["tolerations"][0]["key"] == "aws.amazon.com/neuron"
    # the engine is told it is on Trainium, and refuses that by name instead of serving from the host CPU
    assert pod["containers"][0]["args"][pod["containers"][0]["args"].index("--device") + 1] == "neuron"
    c = builders.build_engine_deployment(IDEP, spec(hardware={"accelerator": "cpu", "cpu": "4", "memory": "8Gi"}))
    pod = c["spec"]["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"memory": "8Gi"}}
    assert "--enforce-eager" in pod["containers"][0]["args"]


def test_user_selector_and_tolerations_merge_over_the_pool():
    s = spec(hardware={"accelerator": "nvidia-h200", "nodeSelector": {"zone": "a"},
                       "tolerations": [{"key": "spot", "operator": "Exists"}]})
    pod = builders.build_engine_deployment(IDEP, s)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200", "zone": "a"}
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "spot"]


def test_pvc_model_is_mounted_read_only():
    s = spec(model={"pvc": {"claimName": "weights", "path": "llama/3.2-1b"}})
    pod = builders.build_engine_deployment(IDEP, s)["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod["volumes"]
    assert pod["containers"][0]["args"][2] == "/models/llama/3.2-1b"


def test_configmap_holds_engine_config_fields_and_rolls_pods_on_change():
    cm = builders.build_engine_configmap(IDEP, spec())
    owner_ok(cm, IDEP)
    cfg = yaml.safe_load(cm["data"]["engine.yaml"])
    assert cfg["model"] == "llama-3.2-1b-shape" and cfg["block_size"] == 16 and cfg["max_num_seqs"] == 64
    from shapeshift.engine.core.config import EngineConfig  # the engine accepts exactly these keys

    EngineConfig(**cfg)
    d1 = builders.build_engine_deployment(IDEP, spec())
    d2 = builders.build_engine_deployment(IDEP, spec(engine={"maxModelLen": 4096}))
    a1 = d1["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH]
    a2 = d2["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH]
    assert a1 != a2


def test_service_selects_engine_pods():
    svc = builders.build_engine_service(IDEP, spec())
    owner_ok(svc, IDEP)
    assert svc["metadata"]["name"] == "llama"
    assert svc["spec"]["selector"] == builders.engine_selector("llama")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_builders_are_deterministic_and_hash_tracks_content():
    a = builders.build_engine_deployment(IDEP, spec())
    b = builders.build_engine_deployment(IDEP, spec())
    assert a == b
    assert a["metadata"]["annotations"][builders.SPEC_HASH] == builders.spec_hash(a)
    c = builders.build_engine_deployment(IDEP, spec(replicas=4))
    assert c["metadata"]["annotations"][builders.SPEC_HASH] != a["metadata"]["annotations"][builders.SPEC_HASH]
    mutated = copy.deepcopy(a)
    mutated["metadata"]["annotations"][builders.SPEC_HASH] = "x"
    assert builders.spec_hash(mutated) == builders.spec_hash(a)  # the hash ignores itself


def test_compile_job_runs_the_worker_on_the_pool():
    job = builders.build_compile_job(RUN, run_spec(), spec())
    owner_ok(job, RUN)
    assert job["metadata"]["name"] == "llama-drift-1-compile"
    js = job["spec"]
    assert js["backoffLimit"] == 1 and js["activeDeadlineSeconds"] == 1800 + 600
    pod = js["template"]["spec"]
    assert pod["restartPolicy"] == "Never" and pod["serviceAccountName"] == "llama-drift-1-compile"
    (c,) = pod["containers"]
    assert c["command"] + c["args"] == ["shapeshift", "compile", "--compile-run", "prod/llama-drift-1"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SHAPESHIFT_NAMESPACE"] == "prod" and env["SHAPESHIFT_COMPILE_RUN"] == "llama-drift-1"
    assert env["SHAPESHIFT_BUDGET_WALL_CLOCK_SECONDS"] == "1800" and env["SHAPESHIFT_BUDGET_TRIALS"] == "200"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert js["template"]["metadata"]["labels"][builders.LABEL_RUN] == "llama-drift-1"
    assert {"name": "engine-config", "configMap": {"name": "llama-engine"}} in pod["volumes"]


def test_compile_job_hardware_override_secret_env_and_trial_only_budget():
    r = run_spec(hardware={"accelerator": "trainium2"}, budget={"wallClockSeconds": 0, "trials": 50},
                 agents=[{"kind": "llm", "llm": {"endpoint": "http://llm:8080/v1", "model": "m",
                                                 "apiKeySecretRef": {"name": "llm-key"}}}])
    job = builders.build_compile_job(RUN, r, spec())
    pod = job["spec"]["template"]["spec"]
    assert "activeDeadlineSeconds" not in job["spec"]
    assert pod["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn2.48xlarge"}
    key = next(e for e in pod["containers"][0]["env"] if e["name"] == "SHAPESHIFT_AGENT_0_API_KEY")
    assert key["valueFrom"] == {"secretKeyRef": {"name": "llm-key", "key": "api-key"}}


def test_compile_rbac_is_least_privilege():
    sa, role, binding = builders.build_compile_rbac(RUN, run_spec())
    for obj in (sa, role, binding):
        owner_ok(obj, RUN)
        assert obj["metadata"]["name"] == "llama-drift-1-compile"
    rules = {(tuple(r["resources"]), tuple(r.get("resourceNames", []))): set(r["verbs"]) for r in role["rules"]}
    assert rules[(("compileruns",), ("llama-drift-1",))] == {"get"}
    assert rules[(("compileruns/status",), ("llama-drift-1",))] == {"get", "patch"}
    assert rules[(("inferencedeployments",), ("llama",))] == {"get"}
    assert rules[(("forwardpasses",), ())] == {"get", "list", "create"}
    assert all(r["apiGroups"] == ["shapeshift.dev"] for r in role["rules"])
    assert not any("*" in r["verbs"] or "secrets" in r["resources"] for r in role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "prod"}]


def test_engine_follows_its_pod_annotations_through_a_downward_api_volume():
    from shapeshift.engine.contracts.pod_annotations import DEFAULT_ANNOTATIONS_FILE, DOWNWARD_API_MOUNT_PATH

    pod = builders.build_engine_deployment(IDEP, spec())["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    volume = next(v for v in pod["spec"]["volumes"] if "downwardAPI" in v)
    assert volume["downwardAPI"]["items"] == [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == DOWNWARD_API_MOUNT_PATH and mount["readOnly"] is True
    args = c["args"]
    assert args[args.index("--desired-forward-pass-file") + 1] == DEFAULT_ANNOTATIONS_FILE
    assert DEFAULT_ANNOTATIONS_FILE.startswith(DOWNWARD_API_MOUNT_PATH + "/")
    # No mount point inside another (read-only) mount: the runtime could not create it.
    paths = [m["mountPath"].rstrip("/") for m in c["volumeMounts"]]
    assert not [(a, b) for a in paths for b in paths if a != b and b.startswith(a + "/")], paths
    assert "--admin-token-file" not in args and not any("secret" in v for v in pod["spec"]["volumes"])


def test_admin_token_secret_is_mounted_and_named_on_the_command_line():
    pod = builders.build_engine_deployment(IDEP, spec(engine={"adminTokenSecret": {"name": "engine-admin"}}))
    pod = pod["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    volume = next(v for v in pod["spec"]["volumes"] if "secret" in v)
    assert volume["secret"]["secretName"] == "engine-admin"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    mount = next(m for m in c["volumeMounts"] if m["name"] == volume["name"])
    token_file = c["args"][c["args"].index("--admin-token-file") + 1]
    assert token_file == f"{mount['mountPath']}/token" and mount["readOnly"] is True


def test_template_annotations_change_the_spec_hash_and_only_the_template():
    plain = builders.build_engine_deployment(IDEP, spec())
    pinned = builders.build_engine_deployment(IDEP, spec(), {"shapeshift.dev/forward-pass": "fp-2"})
    assert pinned["spec"]["template"]["metadata"]["annotations"]["shapeshift.dev/forward-pass"] == "fp-2"
    assert "shapeshift.dev/forward-pass" not in plain["spec"]["template"]["metadata"]["annotations"]
    assert plain["metadata"]["annotations"][builders.SPEC_HASH] != pinned["metadata"]["annotations"][builders.SPEC_HASH]
    assert builders.build_engine_deployment(IDEP, spec(), {}) == plain


def test_engine_env_reaches_the_engine_and_compile_pods_and_rolls_the_engine():
    switches = [{"name": "SHAPESHIFT_PDL", "value": "0"}, {"name": "NCCL_DEBUG", "value": "WARN"}]
    with_env = spec(engine={"env": switches})
    d = builders.build_engine_deployment(IDEP, with_env)
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert c["env"][-2:] == switches
    job = builders.build_compile_job(RUN, run_spec(), with_env)
    job_env = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert job_env[-3:-1] == switches
    # the worker records these names' values in its ForwardPass (spec.engine.env)
    assert job_env[-1] == {"name": "SHAPESHIFT_ENGINE_ENV_NAMES", "value": "SHAPESHIFT_PDL,NCCL_DEBUG"}
    plain_job = builders.build_compile_job(RUN, run_spec(), spec())
    assert {"name": "SHAPESHIFT_ENGINE_ENV_NAMES", "value": ""} in plain_job["spec"]["template"]["spec"]["containers"][0]["env"]
    plain = builders.build_engine_deployment(IDEP, spec())
    assert builders.spec_hash(plain) != builders.spec_hash(d)
    assert not {e["name"] for e in plain["spec"]["template"]["spec"]["containers"][0]["env"]} & {"SHAPESHIFT_PDL"}


def test_reserved_env_names_cover_every_name_the_operator_sets():
    """A name the builders set that RESERVED_ENV_NAMES misses could be set twice in one container."""
    from shapeshift.operator.api import RESERVED_ENV_NAMES, RESERVED_ENV_PREFIX

    full = spec(artifacts={"pvc": {"claimName": "artifacts"}})
    r = run_spec(agents=[{"kind": "llm", "llm": {"endpoint": "http://llm:8080/v1", "model": "m",
                                                 "apiKeySecretRef": {"name": "llm-key"}}}])
    containers = [builders.build_engine_deployment(IDEP, full)["spec"]["template"]["spec"]["containers"][0],
                  builders.build_compile_job(RUN, r, full)["spec"]["template"]["spec"]["containers"][0]]
    names = {e["name"] for c in containers for e in c["env"]}
    assert {"SHAPESHIFT_ARTIFACT_DIR", "SHAPESHIFT_AGENT_0_API_KEY", "SHAPESHIFT_ENGINE_CONFIG"} <= names
    assert {n for n in names if n not in RESERVED_ENV_NAMES and not n.startswith(RESERVED_ENV_PREFIX)} == set()


def test_engine_env_refuses_names_the_operator_sets_duplicates_and_non_identifiers():
    import pytest
    from pydantic import ValidationError

    for env, message in (([{"name": "POD_NAME", "value": "x"}], "set by the operator itself"),
                         ([{"name": "SHAPESHIFT_AGENT_3_API_KEY"}], "set by the operator itself"),
                         ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "duplicate names"),
                         ([{"name": "1BAD"}], "should match pattern")):
        with pytest.raises(ValidationError, match=message):
            spec(engine={"env": env})
    assert spec(engine={"env": [{"name": "SHAPESHIFT_PDL"}]}).engine.env[0].value == ""



def test_metrics_compat_reaches_the_engine_command_line():
    plain = builders.build_engine_deployment(IDEP, spec())["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--metrics-compat" not in plain
    compat = spec(engine={"metricsCompat": "vllm"})
    assert compat.engine.metrics_compat == "vllm"
    args = builders.build_engine_deployment(IDEP, compat)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--metrics-compat") + 1] == "vllm"
    # The flag is one the engine's own parser takes, with the value the CRD allows.
    from shapeshift.engine.cli import build_parser
    assert build_parser().parse_args(args).metrics_compat == "vllm"
    # and the CRD allows exactly the values the engine's parser takes
    import typing
    from shapeshift.operator.api import EngineSettings
    parser = build_parser()
    command = next(a for a in parser._actions if a.choices and args[0] in a.choices).choices[args[0]]
    choices = next(a.choices for a in command._actions if a.dest == "metrics_compat")
    allowed = typing.get_args(typing.get_args(EngineSettings.model_fields["metrics_compat"].annotation)[0])
    assert set(allowed) == set(choices), (allowed, choices)
    try:
        spec(engine={"metricsCompat": "prometheus"})
    except ValueError as err:
        assert "metricsCompat" in str(err)
    else:
        raise AssertionError("metricsCompat accepted a value the engine does not know")
