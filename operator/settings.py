"""Operator-wide settings: every SHAPESHIFT_* variable the operator reads, with its default.

    environment (the Helm chart sets it; `shapeshift operator --resync-seconds`
    sets SHAPESHIFT_RESYNC_SECONDS) --OperatorSettings.from_environ()--> OperatorSettings
        timer intervals   registered_timers(): read once, when the handlers are imported
                          (kopf fixes a timer's interval when the decorator runs)
        everything else   each drift check and rollout tick takes OperatorSettings.from_environ()
                          and passes it down to the plain functions it calls

Only the kubeconfig variables (KUBECONFIG, KUBERNETES_SERVICE_HOST) are read elsewhere
(operator/kube.py, the login handler): they belong to the Kubernetes client, not to Shapeshift.
"""

from __future__ import annotations

import functools
import ipaddress
import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["NO_PROMETHEUS_ADDRESS", "OperatorSettings", "registered_timers"]

NO_PROMETHEUS_ADDRESS = ("no Prometheus address: set the chart value prometheus.url "
                         "(SHAPESHIFT_PROMETHEUS_URL) or spec.prometheusUrl")


@dataclass(frozen=True)
class OperatorSettings:
    """What the operator's handlers and timers are configured with."""

    resync_seconds: float = 10.0  # SHAPESHIFT_RESYNC_SECONDS: InferenceDeployment and CompileRun timers
    drift_timer_seconds: float = 10.0  # SHAPESHIFT_DRIFT_TIMER_SECONDS
    rollout_timer_seconds: float = 10.0  # SHAPESHIFT_ROLLOUT_TIMER_SECONDS, else the resync interval
    prometheus_url: str | None = None  # SHAPESHIFT_PROMETHEUS_URL; spec.prometheusUrl overrides it
    prometheus_namespace_label: str = "namespace"  # SHAPESHIFT_PROMETHEUS_NAMESPACE_LABEL
    prometheus_deployment_label: str = "deployment"  # SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL
    prometheus_pod_label: str = "pod"  # SHAPESHIFT_PROMETHEUS_POD_LABEL
    prometheus_timeout_seconds: float = 5.0  # SHAPESHIFT_PROMETHEUS_TIMEOUT_SECONDS
    drift_min_requests: int = 20  # SHAPESHIFT_DRIFT_MIN_REQUESTS: fewer in the window is not evidence
    rollout_min_requests: float = 20  # SHAPESHIFT_ROLLOUT_MIN_REQUESTS: canary requests needed to judge
    # SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS. The engine's inter-token histogram has
    # 0.5-2 ms wide buckets below 10 ms; p90 differences smaller than that are interpolation noise.
    rollout_latency_resolution_seconds: float = 0.002
    # SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS: comma-separated CIDRs the operator may connect to although they
    # are link-local or cloud metadata addresses (operator/outbound.py); empty: none.
    outbound_allowed_cidrs: tuple[str, ...] = ()
    # SHAPESHIFT_HANDLER_WORKERS: threads that run the (synchronous) handlers and timers. Each drift
    # check, rollout tick and resync holds one while it waits on the API server or Prometheus; kopf's
    # default (cores + 4) leaves hundreds of deployments' timers queued behind a few (see
    # hack/bench_operator_scale.py).
    handler_workers: int = 32
    # SHAPESHIFT_DRIFT_BATCH_SECONDS: the drift scheduler's tick (operator/drift_scheduler.py): the
    # deployments whose check fell due since the last tick are observed in one batch.
    drift_batch_seconds: float = 1.0
    # SHAPESHIFT_SAVINGS_REFRESH_SECONDS: how old the served load behind the current regime's champion's
    # saved-per-day and payback may get before a drift check reads it again from Prometheus.
    savings_refresh_seconds: float = 900.0

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> "OperatorSettings":
        """Read ``env`` (default: the process environment). An empty value means the default,
        except for SHAPESHIFT_RESYNC_SECONDS and SHAPESHIFT_DRIFT_TIMER_SECONDS, which must be
        numbers when set."""
        env = os.environ if env is None else env
        return cls(
            resync_seconds=float(env.get("SHAPESHIFT_RESYNC_SECONDS", "10")),
            drift_timer_seconds=float(env.get("SHAPESHIFT_DRIFT_TIMER_SECONDS", "10")),
            rollout_timer_seconds=float(env.get("SHAPESHIFT_ROLLOUT_TIMER_SECONDS")
                                        or env.get("SHAPESHIFT_RESYNC_SECONDS") or "10"),
            prometheus_url=env.get("SHAPESHIFT_PROMETHEUS_URL") or None,
            prometheus_namespace_label=env.get("SHAPESHIFT_PROMETHEUS_NAMESPACE_LABEL") or "namespace",
            prometheus_deployment_label=env.get("SHAPESHIFT_PROMETHEUS_DEPLOYMENT_LABEL") or "deployment",
            prometheus_pod_label=env.get("SHAPESHIFT_PROMETHEUS_POD_LABEL") or "pod",
            prometheus_timeout_seconds=float(env.get("SHAPESHIFT_PROMETHEUS_TIMEOUT_SECONDS") or 5.0),
            drift_min_requests=int(env.get("SHAPESHIFT_DRIFT_MIN_REQUESTS") or 20),
            rollout_min_requests=float(env.get("SHAPESHIFT_ROLLOUT_MIN_REQUESTS") or 20),
            rollout_latency_resolution_seconds=float(
                env.get("SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS") or 0.002),
            outbound_allowed_cidrs=_cidrs(env.get("SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS") or ""),
            handler_workers=max(1, int(env.get("SHAPESHIFT_HANDLER_WORKERS") or 32)),
            drift_batch_seconds=float(env.get("SHAPESHIFT_DRIFT_BATCH_SECONDS") or 1.0),
            savings_refresh_seconds=float(env.get("SHAPESHIFT_SAVINGS_REFRESH_SECONDS") or 900.0),
        )


def _cidrs(text: str) -> tuple[str, ...]:
    """SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS as networks; ValueError names the one that does not parse."""
    out = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            out.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError:
            raise ValueError(f"SHAPESHIFT_OUTBOUND_ALLOWED_CIDRS: {item!r} is not a CIDR (e.g. 169.254.10.0/24)") from None
    return tuple(out)


@functools.cache
def registered_timers() -> OperatorSettings:
    """The settings the kopf timers were registered with: read on first call, which is the
    import of the handlers, and never again in this process."""
    return OperatorSettings.from_environ()
