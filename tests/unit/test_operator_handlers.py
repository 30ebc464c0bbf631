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
        "start_drift_scheduler", "stop_drift_scheduler"}
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
