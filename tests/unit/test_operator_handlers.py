"""The operator's handler layer without a cluster: one settings object (names, defaults,
what the timers were registered with), every handler registered by importing the package,
one writer of the engine Deployment, and the small decisions the handlers apply."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shapeshift.operator.api import Condition
from shapeshift.operator.settings import OperatorSettings
from shapeshift.operator.status import StatusUpdate, compile_run_event, newly_unschedulable

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def test_settings_defaults_match_the_environment_names():
    assert OperatorSettings.from_environ({}) == OperatorSettings()
    assert OperatorSettings() == OperatorSettings(
        resync_seconds=10.0, drift_timer_seconds=10.0, rollout_timer_seconds=10.0, prometheus_url=None,
        prometheus_namespace_label="namespace", prometheus_deployment_label="deployment",
        prometheus_pod_label="pod", prometheus_timeout_seconds=5.0, drift_min_requests=20,
        rollout_min_requests=20, rollout_latency_resolution_seconds=0.002)
    env = {"SHAPESHIFT_RESYNC_SECONDS": "2", "SHAPESHIFT_DRIFT_TIMER_SECONDS": "3",
           "SHAPESHIFT_PROMETHEUS_URL": "http://prom:9090", "SHAPESHIFT_PROMETHEUS_NAMESPACE_LABEL": "ns",
           "SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL": "app", "SHAPESHIFT_PROMETHEUS_POD_LABEL": "pod_name",
           "SHAPESHIFT_PROMETHEUS_TIMEOUT_SECONDS": "1.5", "SHAPESHIFT_DRIFT_MIN_REQUESTS": "7",
           "SHAPESHIFT_ROLLOUT_MIN_REQUESTS": "5", "SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS": "0.01"}
    assert OperatorSettings.from_environ(env) == OperatorSettings(
        resync_seconds=2.0, drift_timer_seconds=3.0, rollout_timer_seconds=2.0, prometheus_url="http://prom:9090",
        prometheus_namespace_label="ns", prometheus_deployment_label="app", prometheus_pod_label="pod_name",
        prometheus_timeout_seconds=1.5, drift_min_requests=7, rollout_min_requests=5.0,
        rollout_latency_resolution_seconds=0.01)


def test_the_rollout_tick_defaults_to_the_resync_interval_and_can_have_its_own():
    assert OperatorSettings.from_environ({"SHAPESHIFT_RESYNC_SECONDS": "4"}).rollout_timer_seconds == 4.0
    assert OperatorSettings.from_environ({"SHAPESHIFT_RESYNC_SECONDS": "4",
                                          "SHAPESHIFT_ROLLOUT_TIMER_SECONDS": "1"}).rollout_timer_seconds == 1.0
    # the drift timer does not follow the resync interval
    assert OperatorSettings.from_environ({"SHAPESHIFT_RESYNC_SECONDS": "4"}).drift_timer_seconds == 10.0


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        OperatorSettings().resync_seconds = 1  # type: ignore[misc]


def _reads_shapeshift_variables(path: Path) -> bool:
    """``<mapping>.get("SHAPESHIFT_...")``, ``os.getenv("SHAPESHIFT_...")`` or ``os.environ["SHAPESHIFT_..."]``."""
    def named(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SHAPESHIFT_")

    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "getenv") and node.args and named(node.args[0])):
            return True
        if isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "environ" and named(node.slice):
            return True
    return False


def test_only_operator_settings_reads_shapeshift_variables():
    readers = sorted(str(path.relative_to(OPERATOR)) for path in OPERATOR.rglob("*.py")
                     if _reads_shapeshift_variables(path))
    # main.py sets SHAPESHIFT_RESYNC_SECONDS from --resync-seconds before the handlers are imported
    assert readers == ["main.py", "settings.py"]


def test_importing_the_package_registers_every_handler_with_the_settings_intervals():
    import kopf

    from shapeshift.operator import handlers  # noqa: F401  (registers)
    from shapeshift.operator.settings import registered_timers

    registry = kopf.get_default_registry()
    ours = {h.id: h for sub in (registry._activities, registry._changing, registry._spawning)
            for h in sub.get_all_handlers() if h.fn.__module__.startswith("shapeshift.operator.handlers")}
    assert {key.split("/")[0] for key in ours} == {
        "configure", "login", "inference_deployment_reconcile", "inference_deployment_observe",
        "compile_run_start", "compile_run_observe", "drift_check", "rollout_tick", "forget_deleted_deployment",
        "stop_drift_scheduler"}
    timers = registered_timers()
    assert ours["inference_deployment_observe"].interval == timers.resync_seconds
    assert ours["compile_run_observe"].interval == timers.resync_seconds
    assert ours["drift_check"].interval == timers.drift_timer_seconds
    assert ours["rollout_tick"].interval == timers.rollout_timer_seconds


def _calls(path: Path, name: str) -> int:
    tree = ast.parse(path.read_text())
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", getattr(node.func, "id", None)) == name)


def test_the_engine_deployment_has_one_writer():
    builders_of_it = {str(p.relative_to(OPERATOR)): _calls(p, "build_engine_deployment")
                      for p in OPERATOR.rglob("*.py")}
    assert {p: n for p, n in builders_of_it.items() if n} == {"handlers/children.py": 1}
    writers = {str(p.relative_to(OPERATOR)): _calls(p, "ensure_engine_deployment") for p in OPERATOR.rglob("*.py")}
    # the reconcile reaches it through engine_child_writers, the rollout tick directly
    assert {p: n for p, n in writers.items() if n} == {"handlers/children.py": 1, "handlers/rollout.py": 1}


def test_an_unschedulable_pod_is_news_once():
    update = StatusUpdate({}, [("Scheduled", "False", "Unschedulable", "pod e-0: no node fits")])
    assert newly_unschedulable(None, update) == "pod e-0: no node fits"
    bound = [Condition(type="Scheduled", status="True", reason="Bound", message="")]
    assert newly_unschedulable(bound, update) == "pod e-0: no node fits"
    already = [Condition(type="Scheduled", status="False", reason="Unschedulable", message="older")]
    assert newly_unschedulable(already, update) is None
    assert newly_unschedulable(None, StatusUpdate({}, [("Scheduled", "True", "Bound", "")])) is None


def test_compile_run_phase_changes_post_one_event():
    assert compile_run_event("Running", {"phase": "Succeeded", "message": "champion fp-2"}) == (
        "Normal", "Succeeded", "champion fp-2")
    assert compile_run_event("Running", {"phase": "Failed", "message": "OOM"}) == ("Warning", "Failed", "OOM")
    assert compile_run_event("Pending", {"phase": "Scheduled"}) == ("Normal", "Scheduled", "")
    assert compile_run_event("Running", {"phase": "Running", "message": "x"}) is None
    assert compile_run_event("Running", {"phase": "Verifying"}) is None


class _StatusStore:
    """The few Kube calls the observe handlers make, with a status that merges like the API's."""

    def __init__(self, pods, deployment=None, job=None):
        self.pods, self.deployment, self.job = pods, deployment, job
        self.status: dict = {}

    def list(self, kind, namespace, selector):
        return self.pods

    def get(self, kind, namespace, name):
        return self.job

    def get_custom(self, kind, namespace, name):
        return {"metadata": {"name": name, "namespace": namespace, "uid": "uid-run", "generation": 1},
                "status": self.status}

    def write_status(self, kind, namespace, name, update, generation=None, read=None):
        before = self.status
        conditions = {c["type"]: c for c in before.get("conditions", [])}
        for type_, status, reason, message in update.conditions:
            conditions[type_] = {"type": type_, "status": status, "reason": reason, "message": message}
        fields = {k: v for k, v in update.fields.items() if v is not None}
        self.status = {**before, **fields, "conditions": list(conditions.values())}
        return self.status != before, self.status


def _crashing(name, code, message):
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": {"nodeName": "gpu-0"},
            "status": {"phase": "Running", "containerStatuses": [{"name": "engine", "state": {"terminated": {
                "exitCode": code, "reason": "Error", "message": message}}}]}}


def test_pods_healthy_and_pods_created_turning_false_post_one_warning_per_message(monkeypatch):
    """The resync's Warning events: one when PodsHealthy or PodsCreated turns False, one more when
    the failure's message changes, none on the ticks that find the same failure again."""
    import kopf

    from shapeshift.operator.api import InferenceDeploymentSpec
    from shapeshift.operator.handlers import deployment as handler

    warned: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append((reason, message)))
    spec = InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}})
    engine = {"metadata": {"name": "llama-engine", "generation": 1},
              "status": {"observedGeneration": 1, "replicas": 1, "conditions": []}}
    kube = _StatusStore([_crashing("p1", 3, "CUDA error: no kernel image")])

    def tick():
        body = {"metadata": {"name": "llama", "namespace": "ns", "generation": 1}, "status": kube.status}
        handler._observe_engine(body, spec, kube, (None, engine))

    tick()
    tick()
    assert [(r, "exit code 3" in m) for r, m in warned] == [("PodsFailing", True)]
    kube.pods = [_crashing("p1", 4, "out of memory")]
    tick()
    tick()
    assert [r for r, _ in warned] == ["PodsFailing", "PodsFailing"] and "exit code 4" in warned[1][1]
    kube.pods = []
    engine["status"]["conditions"] = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                                       "message": "exceeded quota: gpus"}]
    tick()
    tick()
    assert warned[2:] == [("ReplicaFailure", "Deployment llama-engine cannot create pods: exceeded quota: gpus")]
    engine["status"]["conditions"] = []
    tick()
    assert len(warned) == 3  # recovered: no event


def test_a_failed_compile_attempt_posts_one_pod_failed_warning_per_failure(monkeypatch):
    import kopf

    from shapeshift.operator.handlers import compile_run as handler

    warned: list[tuple[str, str]] = []
    monkeypatch.setattr(kopf, "warn", lambda body, reason, message: warned.append((reason, message)))
    monkeypatch.setattr(kopf, "info", lambda body, reason, message: None)
    job = {"metadata": {"name": "run-compile", "ownerReferences": [{"uid": "uid-run"}]},
           "status": {"startTime": "2026-01-01T00:00:00Z", "active": 1}}
    first = _crashing("p1", 137, "worker out of memory")
    first["status"]["phase"] = "Failed"
    retry = {"metadata": {"name": "p2", "creationTimestamp": "2026-01-01T00:01:00Z"}, "spec": {"nodeName": "gpu-0"},
             "status": {"phase": "Running", "containerStatuses": [{"name": "engine", "state": {"running": {}}}]}}
    kube = _StatusStore([first, retry], job=job)
    kube.status = {"phase": "Running"}
    body = {"metadata": {"name": "run", "namespace": "ns"}}
    handler._observe_run(body, kube)
    handler._observe_run(body, kube)
    assert [r for r, _ in warned] == ["ContainerFailed"] and "exit code 137" in warned[0][1]
    second = _crashing("p2", 2, "bad recipe")
    second["metadata"]["creationTimestamp"] = "2026-01-01T00:01:00Z"
    kube.pods = [first, second, dict(retry, metadata={"name": "p3", "creationTimestamp": "2026-01-01T00:02:00Z"})]
    handler._observe_run(body, kube)
    handler._observe_run(body, kube)
    assert [r for r, _ in warned] == ["ContainerFailed", "ContainerFailed"] and "bad recipe" in warned[1][1]


def test_newly_failing_is_news_once_per_message():
    from shapeshift.operator.status import newly_failing

    update = StatusUpdate({}, [("PodsHealthy", "False", "PodsFailing", "pod p1: exit code 3"),
                               ("PodsCreated", "True", "Created", "ok"), ("PodFailed", "False", "NoFailure", "")])
    assert newly_failing(None, update) == [("PodsFailing", "pod p1: exit code 3")]
    same = [Condition(type="PodsHealthy", status="False", reason="PodsFailing", message="pod p1: exit code 3")]
    assert newly_failing(same, update) == []
    other = [Condition(type="PodsHealthy", status="False", reason="PodsFailing", message="pod p0: exit code 1")]
    assert newly_failing(other, update) == [("PodsFailing", "pod p1: exit code 3")]
    healthy = [Condition(type="PodsHealthy", status="True", reason="NoFailures", message="pod p1: exit code 3")]
    assert newly_failing(healthy, update) == [("PodsFailing", "pod p1: exit code 3")]
