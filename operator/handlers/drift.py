"""The drift timer: Prometheus -> observed traffic -> decision -> status (+ a CompileRun).

    spec, status, the deployment's active CompileRun (API), observe() (Prometheus)
        --drift_check.check_drift--> DriftCheck
        --apply--> create the CompileRun (OnDrift), a Warning event when the traffic becomes
                   unobservable, the status (unless only the check time changed)
    the regime library (operator/regimes.py): before the check, the champion of each regime's
        finished CompileRun is recorded once the rollout's trust rules accept it (resolve_target);
        a switch to a known regime's champion is an event RegimeSwitched, and the rollout timer
        takes it as its target (regimes.target_forward_pass)

The timer ticks every SHAPESHIFT_DRIFT_TIMER_SECONDS (default 10) and does nothing but register
the deployment with the operator-wide drift scheduler (operator/drift_scheduler.py, one thread):
what its spec says to observe, its kopf context and logger, and the apply below. The scheduler
keeps each deployment's due time itself (status.drift.lastCheckTime + checkIntervalSeconds at
first, then its last check + checkIntervalSeconds), so the timer's phase does not stretch the
pace. Every tick (SHAPESHIFT_DRIFT_BATCH_SECONDS, default 1) it reads the traffic of every
deployment due with one PromQL query per series per Prometheus address and window
(operator/prometheus_batch.py) and the CompileRuns of each namespace once, then runs ``_apply`` for
each on a pool of threads without waiting for them: ``_apply`` takes the status from kopf's live
body (the last watch event's), so the status write needs no read of its own. The Prometheus
settings (address, target label names, timeout, minimum requests) are operator/settings.py's.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import kopf
from kubernetes.client import ApiException

from shapeshift.operator.api import (
    COMPILE_RUN,
    FORWARD_PASS,
    GROUP,
    INFERENCE_DEPLOYMENT,
    VERSION,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
    parse_time,
)
from shapeshift.operator.builders import Parent
from shapeshift.operator.compile_economics import champion_economics, of_record, refreshed_economics
from shapeshift.operator.handlers.errors import UNREACHABLE, unreachable
from shapeshift.operator.drift_scheduler import DriftScheduler, Registration
from shapeshift.operator.drift_check import active_compile_run, check_drift, selector_for, thresholds_of
from shapeshift.operator.kube import Kube, kube_of
from shapeshift.operator.prometheus import ObservedTraffic, TrafficQueryError
from shapeshift.operator.provenance import publishing_run
from shapeshift.operator.regimes import RegimeLibrary, pending_champions, record_champion, refresh_savings
from shapeshift.operator.rollout_target import resolve_target
from shapeshift.operator.settings import NO_PROMETHEUS_ADDRESS, OperatorSettings, registered_timers

TIMER_SECONDS = registered_timers().drift_timer_seconds
LOG = logging.getLogger(__name__)


class _NoPrometheusAddress(TrafficQueryError):
    reason = "PrometheusUnreachable"


@kopf.on.cleanup()
def stop_drift_scheduler(**_: Any) -> None:
    """The operator-wide drift scheduler (operator/drift_scheduler.py): one thread, batched reads.
    It starts with the first registration (drift_check below), not at startup: a replica that
    peering pauses runs no timers, so it never starts the thread, and the registrations of a
    replica paused later stop with its timers (kopf sets their `stopped`) and leave the scheduler."""
    SCHEDULER.stop()


@kopf.timer(GROUP, VERSION, INFERENCE_DEPLOYMENT.plural, interval=TIMER_SECONDS, initial_delay=1.0)
async def drift_check(spec: kopf.Spec, status: kopf.Status, name: str, namespace: str, body: kopf.Body,
                      memo: kopf.Memo, logger: logging.Logger, stopped: Any, **_: Any) -> None:
    """Register the deployment with the drift scheduler, which keeps its due time, observes the
    traffic of all due deployments in one batch and then judges drift and writes status (``_apply``).
    Asynchronous, as it waits on nothing: it runs on kopf's event loop, so a registration does not
    wait for one of the handler threads the rollout ticks and resyncs hold."""
    try:
        typed_spec = InferenceDeploymentSpec.model_validate(dict(spec))
    except ValueError as err:  # the API server's schema should have refused it; nothing to observe
        raise kopf.PermanentError(f"spec does not parse: {err}") from err
    typed_status = InferenceDeploymentStatus.model_validate(dict(status or {}))
    uid = body["metadata"].get("uid", f"{namespace}/{name}")
    settings = OperatorSettings.from_environ()
    kube = kube_of(memo)
    thresholds = thresholds_of(typed_spec)

    def apply(observed: ObservedTraffic | TrafficQueryError | None, at: datetime, runs: Any) -> None:
        if isinstance(runs, BaseException):
            raise runs
        read = _live(body)  # kopf's body of a timer is live: the status as the last watch event had it
        if read is None:
            return  # deleted meanwhile
        live_status = InferenceDeploymentStatus.model_validate(read.get("status") or {})
        _apply(kube, settings, typed_spec, live_status, name, namespace, body, logger, observed, at, runs, read)

    SCHEDULER.register(Registration(
        uid=uid, name=name, interval_seconds=float(thresholds.check_interval_seconds),
        url=typed_spec.prometheus_url or settings.prometheus_url, window_seconds=thresholds.window_seconds,
        selector=selector_for(namespace, name, typed_spec, settings),
        timeout_seconds=settings.prometheus_timeout_seconds, allowed_cidrs=settings.outbound_allowed_cidrs,
        apply=apply, shared_key=namespace, read_shared=lambda: _compile_runs(kube, namespace),
        last_check=typed_status.drift.last_check_time if typed_status.drift else None,
        stopped=stopped.is_set))


def _live(body: kopf.Body) -> dict[str, Any] | None:
    """One consistent copy of the live body's metadata and status (kopf swaps the whole body on
    each watch event, from its event loop's thread): read until the resourceVersion holds still."""
    for _ in range(5):
        version = body.metadata.get("resourceVersion")
        copy = {"metadata": dict(body.metadata), "status": dict(body.get("status") or {})}
        if body.metadata.get("resourceVersion") == version:
            return copy if version is not None else None
    return None


def _compile_runs(kube: Kube, namespace: str) -> list[dict[str, Any]]:
    """The namespace's CompileRuns: read once per scheduler round for all its due deployments."""
    try:
        return kube.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, COMPILE_RUN.plural)["items"]
    except ApiException as err:
        raise kopf.TemporaryError(f"listing CompileRuns in {namespace} failed ({err.status} {err.reason})",
                                  delay=15) from err


def _failed(registration: Registration, err: BaseException) -> None:
    """A check that failed (API errors): due again after a drift timer tick."""
    if isinstance(err, (kopf.TemporaryError, kopf.PermanentError)):
        LOG.warning("drift check of %s failed: %s", registration.name, err)
    elif isinstance(err, UNREACHABLE):
        LOG.warning("drift check of %s failed: %s; retrying", registration.name, unreachable(err))
    else:
        LOG.error("drift check of %s failed", registration.name, exc_info=err)


SCHEDULER = DriftScheduler(tick_seconds=registered_timers().drift_batch_seconds,
                           retry_seconds=TIMER_SECONDS, on_failure=_failed)


def _apply(kube: Kube, settings: OperatorSettings, typed_spec: InferenceDeploymentSpec,
           typed_status: InferenceDeploymentStatus, name: str, namespace: str, body: kopf.Body,
           logger: logging.Logger, observed: ObservedTraffic | TrafficQueryError | None, now: datetime,
           runs: list[dict[str, Any]], read: dict[str, Any]) -> None:
    """One deployment's check from its slice of the batched observation and the namespace's
    CompileRuns of the round: judge drift, create, write (merged into ``read``, the live body's
    copy, so a write costs no read unless another writer came in between)."""

    def observe() -> ObservedTraffic:
        if observed is None:
            raise _NoPrometheusAddress(NO_PROMETHEUS_ADDRESS)
        if isinstance(observed, TrafficQueryError):
            raise observed
        return observed

    library = _record_champions(kube, body, typed_spec, typed_status, runs, logger)
    library = _refresh_savings(kube, body, typed_spec, library, runs, settings, now, logger)
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
                          generation=read["metadata"].get("generation"), read=read)
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
        completed = parse_time(run["status"].get("completionTime"))
        # spent from the Job's times, saved from the served tokens/s in Prometheus; also the run's status.economics
        cost = champion_economics(kube, run, forward_pass, spec, body["metadata"]["name"], body["metadata"]["namespace"])
        stored = (run.get("status") or {}).get("economics") or {}
        measured = parse_time(stored.get("measuredAt")) if stored else datetime.now(timezone.utc).replace(microsecond=0)
        library = record_champion(library, regime, forward_pass, run["metadata"]["name"], completed, cost,
                                  engine_image=spec.engine.image, measured_at=measured)
        kopf.info(body, reason="RegimeChampionRecorded",
                  message=f"regime {regime}: champion {champion} of CompileRun {run['metadata']['name']} "
                          f"(speedup {(forward_pass.get('spec') or {}).get('metrics', {}).get('speedup')}; compile "
                          f"spent {cost.compile_accelerator_seconds} accelerator-seconds, saves "
                          f"{cost.saved_accelerator_hours_per_day} accelerator-hours a day at the served load, pays "
                          f"back after {cost.payback_hours} h)"[:1000])
    return library


def _refresh_savings(kube: Kube, body: kopf.Body, spec: InferenceDeploymentSpec, library: RegimeLibrary,
                     runs: list[dict[str, Any]], settings: OperatorSettings, now: datetime,
                     logger: logging.Logger) -> RegimeLibrary:
    """The library with the current regime's champion's saved and payback at the load served now,
    where the load behind them is older than settings.savings_refresh_seconds (its CompileRun's
    status.economics rewritten too); as it was where Prometheus cannot say."""
    regime = library.current.name
    entry = library.get(regime)
    champ = entry.champion if entry is not None else None
    if champ is None or champ.compile_run is None or champ.rolled_back_at is not None:
        return library
    last = champ.savings_measured_at or champ.verified_at
    if last is not None and (now - last).total_seconds() < settings.savings_refresh_seconds:
        return library
    run = next((r for r in runs if r["metadata"]["name"] == champ.compile_run), None)
    if run is None:
        return library
    fresh = refreshed_economics(kube, run, spec, body["metadata"]["name"], body["metadata"]["namespace"],
                                settings=settings, now=now)
    if fresh is None:
        logger.debug("regime %s: served load not read again (no economics or no rate)", regime)
        return library
    logger.info("regime %s: champion %s saves %s accelerator-hours a day at %s output tokens/s (payback %s h)",
                regime, champ.forward_pass, fresh.saved_accelerator_hours_per_day, fresh.served_tokens_per_second,
                fresh.payback_hours)
    return refresh_savings(library, regime, of_record(fresh), fresh.measured_at or now)


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
