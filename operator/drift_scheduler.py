"""The operator-wide drift scheduler: the deployments due for a check, observed in batches.

    the drift timer of each deployment (operator/handlers/drift.py), when its checkIntervalSeconds
      has passed --submit(DueCheck)--> the due set (one entry per deployment)
    one background thread, every tick (SHAPESHIFT_DRIFT_BATCH_SECONDS, default 1 s):
        takes the due set, groups it by (Prometheus URL, window, label layout)
        --per group: operator/prometheus_batch.observe_many, one PromQL query per series for the
          whole group (the outbound policy checked before anything is sent)--> each deployment's
          ObservedTraffic or TrafficQueryError
        --DueCheck.apply(result, now) on a small pool of threads (API reads and writes of the
          check: CompileRuns, champions, status), each in the context of its deployment's timer
          call, so kopf's events post as they did from the timer

The timer keeps each deployment's pace and its kopf context; the batching of Prometheus reads
is what grows with the number of deployments no longer.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

from shapeshift.operator.prometheus import ObservedTraffic, PrometheusTraffic, SeriesSelector, TrafficQueryError
from shapeshift.operator.prometheus_batch import batch_key, observe_many

__all__ = ["DriftScheduler", "DueCheck"]

LOG = logging.getLogger(__name__)


@dataclass
class DueCheck:
    uid: str
    url: str | None
    window_seconds: int
    selector: SeriesSelector
    name: str
    timeout_seconds: float
    allowed_cidrs: tuple[str, ...]
    # (observed or the error, now) -> None; raises to give up this check
    apply: Callable[[ObservedTraffic | TrafficQueryError | None, datetime], None]
    context: contextvars.Context = field(default_factory=contextvars.copy_context)

    def group(self) -> tuple[Any, ...]:
        return (self.url, self.window_seconds, self.timeout_seconds, self.allowed_cidrs, batch_key(self.selector))


class DriftScheduler:
    def __init__(self, tick_seconds: float = 1.0, workers: int = 32,
                 on_failure: Callable[[DueCheck, BaseException], None] | None = None):
        self.tick_seconds = tick_seconds
        self.workers = workers
        self.on_failure = on_failure
        self._due: dict[str, DueCheck] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0  # batched groups observed, for tests

    def submit(self, check: DueCheck) -> None:
        with self._lock:
            self._due[check.uid] = check
        self.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._due)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="drift-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="drift-check") as pool:
            while not self._stop.wait(self.tick_seconds):
                try:
                    self.run_once(pool)
                except Exception:  # noqa: BLE001 - the scheduler outlives one bad tick
                    LOG.exception("drift scheduler tick failed")

    def run_once(self, pool: concurrent.futures.Executor) -> int:
        """Observe and apply every due check; the number of checks run."""
        with self._lock:
            due, self._due = list(self._due.values()), {}
        if not due:
            return 0
        now = datetime.now(timezone.utc).replace(microsecond=0)
        groups: dict[tuple[Any, ...], list[DueCheck]] = {}
        for check in due:
            groups.setdefault(check.group(), []).append(check)
        futures = []
        for checks in groups.values():
            results = self._observe(checks, now)
            self.batches += 1
            for check in checks:
                futures.append((check, pool.submit(check.context.run, check.apply, results.get(check.uid), now)))
        for check, future in futures:
            try:
                future.result()
            except Exception as err:  # noqa: BLE001 - one deployment's failure is its own
                if self.on_failure is not None:
                    self.on_failure(check, err)
        return len(due)

    @staticmethod
    def _observe(checks: list[DueCheck], now: datetime) -> dict[str, ObservedTraffic | TrafficQueryError]:
        first = checks[0]
        if not first.url:
            return {}  # apply(None, ...) says why: no Prometheus address
        with PrometheusTraffic(first.url, timeout_seconds=first.timeout_seconds,
                               allowed_cidrs=first.allowed_cidrs) as prom:
            return observe_many(prom, {c.uid: c.selector for c in checks}, f"{first.window_seconds}s", at=now,
                                names={c.uid: f"{c.name}-observed" for c in checks})


