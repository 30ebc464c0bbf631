"""A CompileRun's economics: what it spent, what its champion saves, when it pays for itself.

    the run's Job (status.startTime, status.completionTime: the Job controller's real times;
        the run's own copies when the Job is gone), its accelerators (spec.hardware.count, else
        the deployment's)                                              --> accelerator-seconds spent
    the deployment's served output tokens/s (operator/served_rate.py: Prometheus, summed over its
        pods, over spec.compilation.drift.windowSeconds, read now), the champion ForwardPass's
        measured speedup and baseline tokens/s per accelerator (spec.metrics, spec.hardware.count),
        the deployment's accelerators (replicas x per pod)
      --regimes.economics (the formula)--> accelerator-hours saved per day, payback hours
      --> CompileRun status.economics (CompileEconomics), written when the champion is recorded: a
          later call reads it back and gives the same numbers, so the run and the regime library
          say the same
    while traffic is in the champion's regime, every SHAPESHIFT_SAVINGS_REFRESH_SECONDS
    (refreshed_economics): the served rate read again, saved and payback recomputed from it (spent,
    the baseline and the speedup as recorded) --> status.economics and the library's champion

Called where the drift timer records a regime's champion (operator/handlers/drift.py
_record_champions). Prometheus unreachable, refused or without the series leaves the saved
figure and the payback unknown and says why in economics.message; the champion is recorded all
the same (its economics do not gate a switch, only spec.compilation.maxPaybackHours).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Mapping

import kopf
from kubernetes.client import ApiException

from shapeshift.operator import builders
from shapeshift.operator.api import COMPILE_RUN, CompileEconomics, HardwareSpec, InferenceDeploymentSpec, parse_time
from shapeshift.operator.drift_check import selector_for, thresholds_of
from shapeshift.operator.kube import Kube
from shapeshift.operator.prometheus import TrafficQueryError
from shapeshift.operator.regimes import Economics, economics
from shapeshift.operator.served_rate import served_tokens_per_second
from shapeshift.operator.settings import NO_PROMETHEUS_ADDRESS, OperatorSettings
from shapeshift.operator.status import StatusUpdate

__all__ = ["baseline_per_accelerator", "champion_economics", "job_times", "of_record", "refreshed_economics"]


def job_times(job: Mapping[str, Any] | None, run_status: Mapping[str, Any]) -> tuple[datetime | None, datetime | None, str | None]:
    """(start, completion, note) of the run's compile Job: the Job's own status times (completion:
    status.completionTime, else its Complete condition's transition); the run's copies when the Job
    is gone (note says so)."""
    if job is not None:
        st = job.get("status") or {}
        complete = next((c for c in st.get("conditions") or [] if c.get("type") == "Complete"
                         and c.get("status") == "True"), {})
        completed = st.get("completionTime") or complete.get("lastTransitionTime")
        return parse_time(st.get("startTime")), parse_time(completed), None
    return (parse_time(run_status.get("startTime")), parse_time(run_status.get("completionTime")),
            "the Job is gone: its times as the CompileRun's status copied them")


def baseline_per_accelerator(forward_pass: Mapping[str, Any]) -> float | None:
    """Output tokens/s one accelerator served at the old speed on the champion's replay: its
    metrics.baselineTokensPerSecond (else tokensPerSecond / speedup) over its hardware.count."""
    spec = forward_pass.get("spec") or {}
    metrics = spec.get("metrics") or {}
    baseline = metrics.get("baselineTokensPerSecond")
    if not baseline and metrics.get("tokensPerSecond") and metrics.get("speedup"):
        baseline = metrics["tokensPerSecond"] / metrics["speedup"]
    count = int((spec.get("hardware") or {}).get("count") or 1)
    return float(baseline) / count if baseline else None


def of_record(record: CompileEconomics) -> Economics:
    """The economics a stored status.economics says, through the same formula."""
    return economics(started=record.job_start_time, completed=record.job_completion_time,
                     compile_accelerators=record.accelerators, speedup=record.speedup,
                     served_tokens_per_second=record.served_tokens_per_second,
                     baseline_tokens_per_second_per_accelerator=record.baseline_tokens_per_second_per_accelerator,
                     serving_accelerators=record.serving_accelerators or 0)


def _served_rate(spec: InferenceDeploymentSpec, deployment: str, namespace: str, settings: OperatorSettings,
                 now: datetime) -> tuple[Any, str | None]:
    """(the deployment's served output tokens/s now, or None; why not)."""
    url = spec.prometheus_url or settings.prometheus_url
    if url is None:
        return None, f"served tokens/s unknown: {NO_PROMETHEUS_ADDRESS}"
    try:
        return served_tokens_per_second(
            url, selector_for(namespace, deployment, spec, settings), thresholds_of(spec).window_seconds, at=now,
            timeout_seconds=settings.prometheus_timeout_seconds, allowed_cidrs=settings.outbound_allowed_cidrs), None
    except TrafficQueryError as err:
        return None, f"served tokens/s unknown: {err}"


def _measure(kube: Kube, run: Mapping[str, Any], forward_pass: Mapping[str, Any], spec: InferenceDeploymentSpec,
             deployment: str, namespace: str, settings: OperatorSettings, now: datetime) -> CompileEconomics:
    run_spec = run.get("spec") or {}
    hardware = HardwareSpec.model_validate(run_spec["hardware"]) if run_spec.get("hardware") else spec.hardware
    try:
        job = kube.get("Job", namespace, builders.compile_job_name(run["metadata"]["name"]))
    except ApiException as err:
        raise kopf.TemporaryError(f"reading the Job of CompileRun {run['metadata']['name']} failed "
                                  f"({err.status} {err.reason})", delay=15) from err
    started, completed, note = job_times(job, run.get("status") or {})
    notes = [note] if note else []
    window = thresholds_of(spec).window_seconds
    served, why = _served_rate(spec, deployment, namespace, settings, now)
    if why:
        notes.append(why)
    rate = round(served.tokens_per_second, 6) if served else None  # what is stored is what is computed from
    baseline = baseline_per_accelerator(forward_pass)
    baseline = round(baseline, 6) if baseline is not None else None
    if baseline is None:
        notes.append("the champion records no baseline tokens/s: saved unknown")
    speedup = ((forward_pass.get("spec") or {}).get("metrics") or {}).get("speedup")
    serving = spec.replicas * spec.hardware.count
    cost = economics(started=started, completed=completed, compile_accelerators=hardware.count, speedup=speedup,
                     served_tokens_per_second=rate, baseline_tokens_per_second_per_accelerator=baseline,
                     serving_accelerators=serving)
    if cost.compile_accelerator_seconds is None:
        notes.append("the Job's start or completion time is missing: spent unknown")
    return CompileEconomics(
        accelerators=hardware.count, job_start_time=started, job_completion_time=completed,
        accelerator_seconds=cost.compile_accelerator_seconds,
        served_tokens_per_second=rate,
        served_window_seconds=window if served else None, measured_at=served.at if served else None,
        baseline_tokens_per_second_per_accelerator=baseline,
        serving_accelerators=serving, speedup=speedup,
        saved_accelerator_hours_per_day=cost.saved_accelerator_hours_per_day, payback_hours=cost.payback_hours,
        message="; ".join(notes)[:1024] or None)


def champion_economics(kube: Kube, run: Mapping[str, Any], forward_pass: Mapping[str, Any],
                       spec: InferenceDeploymentSpec, deployment: str, namespace: str, *,
                       settings: OperatorSettings | None = None, now: datetime | None = None) -> Economics:
    """The economics of ``run`` (a Succeeded CompileRun of ``deployment``) and its champion
    ``forward_pass``: the run's status.economics when written, else measured now and written there."""
    stored = (run.get("status") or {}).get("economics")
    if stored:
        return of_record(CompileEconomics.model_validate(stored))
    at = (now or datetime.now(timezone.utc)).replace(microsecond=0)
    record = _measure(kube, run, forward_pass, spec, deployment, namespace,
                      settings or OperatorSettings.from_environ(), at)
    try:
        kube.write_status(COMPILE_RUN, namespace, run["metadata"]["name"], StatusUpdate({"economics": record.to_wire()}))
    except ApiException as err:
        raise kopf.TemporaryError(f"writing the economics of CompileRun {run['metadata']['name']} failed "
                                  f"({err.status} {err.reason})", delay=15) from err
    return of_record(record)


def refreshed_economics(kube: Kube, run: Mapping[str, Any], spec: InferenceDeploymentSpec, deployment: str,
                        namespace: str, *, settings: OperatorSettings | None = None,
                        now: datetime | None = None) -> CompileEconomics | None:
    """``run``'s status.economics with the served rate read again now and saved and payback
    recomputed from it (spent, the baseline and the speedup as recorded), written back; None where
    the run has no economics yet or the rate cannot be read now (the record stays as it is)."""
    stored = (run.get("status") or {}).get("economics")
    if not stored:
        return None
    record = CompileEconomics.model_validate(stored)
    settings = settings or OperatorSettings.from_environ()
    at = (now or datetime.now(timezone.utc)).replace(microsecond=0)
    served, _why = _served_rate(spec, deployment, namespace, settings, at)
    if served is None:
        return None
    rate = round(served.tokens_per_second, 6)
    cost = economics(started=record.job_start_time, completed=record.job_completion_time,
                     compile_accelerators=record.accelerators, speedup=record.speedup, served_tokens_per_second=rate,
                     baseline_tokens_per_second_per_accelerator=record.baseline_tokens_per_second_per_accelerator,
                     serving_accelerators=record.serving_accelerators or 0)
    notes = [n for n in (record.message or "").split("; ") if n and not n.startswith("served tokens/s unknown")]
    fresh = record.model_copy(update={
        "served_tokens_per_second": rate, "served_window_seconds": thresholds_of(spec).window_seconds,
        "measured_at": served.at, "saved_accelerator_hours_per_day": cost.saved_accelerator_hours_per_day,
        "payback_hours": cost.payback_hours, "message": "; ".join(notes)[:1024] or None})
    try:
        kube.write_status(COMPILE_RUN, namespace, run["metadata"]["name"], StatusUpdate({"economics": fresh.to_wire()}))
    except ApiException as err:
        raise kopf.TemporaryError(f"writing the economics of CompileRun {run['metadata']['name']} failed "
                                  f"({err.status} {err.reason})", delay=15) from err
    return fresh
