"""The drift timer: Prometheus -> observed traffic -> decision -> status (+ a CompileRun).

    spec, status, the deployment's active CompileRun (API), observe() (Prometheus)
        --drift_check.check_drift--> DriftCheck
        --apply--> create the CompileRun (OnDrift), a Warning event when the traffic becomes
                   unobservable, the status (unless only the check time changed)
    the regime library (operator/regimes.py): before the check, the champion of each regime's
        finished CompileRun is recorded once the rollout's trust rules accept it (resolve_target);
        a switch to a known regime's champion is an event RegimeSwitched, and the rollout timer
        takes it as its target (regimes.target_forward_pass)

The timer ticks every SHAPESHIFT_DRIFT_TIMER_SECONDS (default 10) and skips deployments
whose spec.compilation.drift.checkIntervalSeconds has not passed since
status.drift.lastCheckTime, so each deployment keeps its own pace with one timer; the pace
of checks that wrote nothing is kept in memory. A due deployment is handed to the operator-wide
drift scheduler (operator/drift_scheduler.py, one thread started at startup), which reads the
traffic of every deployment due in its tick (SHAPESHIFT_DRIFT_BATCH_SECONDS, default 1) with one
PromQL query per series per Prometheus address and window (operator/prometheus_batch.py), then
runs ``_apply`` for each, in the context of the timer call that handed it over. The Prometheus settings (address, target
label names, timeout, minimum requests) are operator/settings.py's.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from typing import Any

import kopf
from kubernetes.client import ApiException

from shapeshift.operator.api import (
    COMPILE_RUN,
    FORWARD_PASS,
    GROUP,
    INFERENCE_DEPLOYMENT,
    VERSION,
    HardwareSpec,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    short_error,
)
from shapeshift.operator.builders import Parent
from shapeshift.operator.drift_scheduler import DriftScheduler, DueCheck
from shapeshift.operator.drift_check import active_compile_run, check_drift, is_due, selector_for, thresholds_of
from shapeshift.operator.kube import Kube, kube_of
from shapeshift.operator.prometheus import ObservedTraffic, TrafficQueryError
from shapeshift.operator.provenance import publishing_run
from shapeshift.operator.regimes import RegimeLibrary, economics, pending_champions, record_champion
from shapeshift.operator.rollout_target import resolve_target
from shapeshift.operator.settings import NO_PROMETHEUS_ADDRESS, OperatorSettings, registered_timers

TIMER_SECONDS = registered_timers().drift_timer_seconds
LOG = logging.getLogger(__name__)
_LAST_CHECK: dict[str, datetime] = {}  # uid -> last check, for checks that wrote nothing


class _NoPrometheusAddress(TrafficQueryError):
    reason = "PrometheusUnreachable"


@kopf.on.startup()
def start_drift_scheduler(**_: Any) -> None:
    """The operator-wide drift scheduler (operator/drift_scheduler.py): one thread, batched reads."""
    SCHEDULER.start()


@kopf.on.cleanup()
def stop_drift_scheduler(**_: Any) -> None:
    SCHEDULER.stop()


@kopf.timer(GROUP, VERSION, INFERENCE_DEPLOYMENT.plural, interval=TIMER_SECONDS, initial_delay=1.0)
async def drift_check(spec: kopf.Spec, status: kopf.Status, name: str, namespace: str, body: kopf.Body,
                      memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """When the deployment's check is due, hand it to the drift scheduler, which observes the traffic
    of all due deployments in one batch and then judges drift and writes status (``_apply``).
    Asynchronous, as it waits on nothing: it runs on kopf's event loop, so a deployment's pace does
    not wait for one of the handler threads the rollout ticks and resyncs hold."""
    try:
        typed_spec = InferenceDeploymentSpec.model_validate(dict(spec))
    except ValueError as err:  # the API server's schema should have refused it; nothing to observe
        raise kopf.PermanentError(f"spec does not parse: {err}") from err
    typed_status = InferenceDeploymentStatus.model_validate(dict(status or {}))
    now = datetime.now(timezone.utc).replace(microsecond=0)
    uid = body["metadata"].get("uid", f"{namespace}/{name}")
    if not is_due(typed_status, typed_spec, now, timer_seconds=TIMER_SECONDS, last_in_memory=_LAST_CHECK.get(uid)):
        return
    _LAST_CHECK[uid] = now
    settings = OperatorSettings.from_environ()
    kube = kube_of(memo)

    def apply(observed: ObservedTraffic | TrafficQueryError | None, at: datetime) -> None:
        _LAST_CHECK[uid] = at
        _apply(kube, settings, typed_spec, typed_status, name, namespace, body, logger, observed, at)

    SCHEDULER.submit(DueCheck(
        uid=uid, url=typed_spec.prometheus_url or settings.prometheus_url,
        window_seconds=thresholds_of(typed_spec).window_seconds,
        selector=selector_for(namespace, name, typed_spec, settings), name=name,
        timeout_seconds=settings.prometheus_timeout_seconds, allowed_cidrs=settings.outbound_allowed_cidrs,
        apply=apply))


def _failed(check: DueCheck, err: BaseException) -> None:
    """A check that failed (API errors): due again at the next timer tick."""
    _LAST_CHECK.pop(check.uid, None)
    if isinstance(err, (kopf.TemporaryError, kopf.PermanentError)):
        LOG.warning("drift check of %s failed: %s", check.name, err)
    else:
        LOG.error("drift check of %s failed", check.name, exc_info=err)


SCHEDULER = DriftScheduler(tick_seconds=registered_timers().drift_batch_seconds,
                           on_failure=_failed)


def _apply(kube: Kube, settings: OperatorSettings, typed_spec: InferenceDeploymentSpec,
           typed_status: InferenceDeploymentStatus, name: str, namespace: str, body: kopf.Body,
           logger: logging.Logger, observed: ObservedTraffic | TrafficQueryError | None, now: datetime) -> None:
    """One deployment's check from its slice of the batched observation: judge drift, create, write."""
    try:
        runs = kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural)["items"]
    except ApiException as err:
        raise kopf.TemporaryError(f"listing CompileRuns in {namespace} failed ({err.status} {err.reason})",
                                  delay=15) from err

    def observe() -> ObservedTraffic:
        if observed is None:
            raise _NoPrometheusAddress(NO_PROMETHEUS_ADDRESS)
        if isinstance(observed, TrafficQueryError):
            raise observed
        return observed

    library = _record_champions(kube, body, typed_spec, typed_status, runs, logger)
    check = check_drift(spec=typed_spec, status=typed_status, parent=Parent.from_body(body), observe=observe,
                        active_compile_run=active_compile_run(runs, name), settings=settings, now=now,
                        library=library)
    decision = check.result.decision
    created: str | None = None
    if check.compile_run is not None:
        created = _create_compile_run(kube, check.compile_run)
        regime = f" (regime library: {check.regime.reason})" if check.regime is not None else ""
        kopf.info(body, reason="CompileRunCreated",
                  message=f"drift persisted, created CompileRun {created}: {decision.reason}{regime}"[:1000])
    if check.regime is not None and check.regime.kind == "Switch":
        kopf.info(body, reason="RegimeSwitched", message=check.regime.reason[:1000])
    if check.warning is not None:
        kopf.warn(body, reason=check.warning[0], message=check.warning[1])
    if not check.write:
        logger.debug("drift check: %s, status unchanged", decision.kind)
        return
    try:
        kube.write_status(INFERENCE_DEPLOYMENT, namespace, name, check.update,
                          generation=body["metadata"].get("generation"))
    except ApiException as err:
        raise kopf.TemporaryError(f"writing drift status failed ({err.status} {err.reason})", delay=15) from err
    logger.info("drift check: %s%s%s", decision.kind, f" -> CompileRun {created}" if created else "",
                f" (regime {check.regime.kind} {check.regime.regime})" if check.regime is not None else "")


def _record_champions(kube: Kube, body: kopf.Body, spec: InferenceDeploymentSpec, status: InferenceDeploymentStatus,
                      runs: list[dict[str, Any]], logger: logging.Logger) -> RegimeLibrary:
    """The library with the champion of each regime's finished CompileRun, where the rollout's trust
    rules accept it (a ForwardPass its CompileRun vouches for, for this accelerator and engine env)."""
    library = RegimeLibrary.of(status)
    for regime, run in pending_champions(library, runs):
        champion = run["status"]["champion"]
        try:
            forward_pass = kube.get_custom(FORWARD_PASS, body["metadata"]["namespace"], champion)
        except ApiException as err:
            raise kopf.TemporaryError(f"reading ForwardPass {champion} failed ({err.status} {err.reason})",
                                      delay=15) from err
        publisher = publishing_run(forward_pass, body["metadata"]["namespace"])
        vouching = next((r for r in runs if r["metadata"]["name"] == publisher), None)
        target = resolve_target(champion, forward_pass, spec, vouching, status.verified_forward_passes or [])
        if target.identity is None or forward_pass is None:
            logger.info("regime %s: champion %s of CompileRun %s not recorded: %s", regime, champion,
                        run["metadata"]["name"], target.problem)
            continue
        completed, started = _time(run["status"].get("completionTime")), _time(run["status"].get("startTime"))
        compile_hardware = HardwareSpec.model_validate((run.get("spec") or {}).get("hardware") or {}) \
            if (run.get("spec") or {}).get("hardware") else spec.hardware
        cost = economics(started=started, completed=completed, compile_accelerators=compile_hardware.count,
                         speedup=((forward_pass.get("spec") or {}).get("metrics") or {}).get("speedup"),
                         serving_accelerators=spec.replicas * spec.hardware.count)
        library = record_champion(library, regime, forward_pass, run["metadata"]["name"], completed, cost)
        kopf.info(body, reason="RegimeChampionRecorded",
                  message=f"regime {regime}: champion {champion} of CompileRun {run['metadata']['name']} "
                          f"(speedup {(forward_pass.get('spec') or {}).get('metrics', {}).get('speedup')}; compile "
                          f"spent {cost.compile_accelerator_seconds} accelerator-seconds, pays back after "
                          f"{cost.payback_seconds} s of serving in the regime)"[:1000])
    return library


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _create_compile_run(kube: Kube, body: dict[str, Any]) -> str:
    """Create the CompileRun; one that already exists under the same name (a retried check) is kept."""
    meta = body["metadata"]
    try:
        kube.custom.create_namespaced_custom_object(GROUP, VERSION, meta["namespace"], COMPILE_RUN.plural, body)
    except ApiException as err:
        if err.status != 409:
            raise kopf.TemporaryError(
                f"creating CompileRun {meta['name']} failed ({err.status} {err.reason}): {err.body}", delay=30
            ) from err
    return meta["name"]
