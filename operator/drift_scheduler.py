"""The operator-wide drift scheduler: each deployment's due time, observed in batches, applied
without one check waiting for another.

    the drift timer of each deployment (operator/handlers/drift.py), every tick
        --register(Registration)--> the registry: uid -> the deployment's latest registration (what
          its spec says to observe, its kopf context, its apply) and its due time, kept here:
          first status.drift.lastCheckTime + checkIntervalSeconds (now, when never checked), then
          the time of the check before + checkIntervalSeconds
    one background thread, every tick (SHAPESHIFT_DRIFT_BATCH_SECONDS, default 1 s):
        the deployments that are due and whose previous check has ended, most overdue first, at
          most 1.5 times the checks due per second on average times the seconds since the round
          before (at least one pool's worth): deployments registered together are spread over
          the next rounds instead of queueing their applies behind each other
        --grouped by (Prometheus URL, window, timeout, allow-list, label layout); per group
          operator/prometheus_batch.observe_many, one PromQL query per series for the whole group
          (the outbound policy checked before anything is sent)--> each ObservedTraffic or
          TrafficQueryError
        --per shared key of the round (the namespace): read_shared() once (its CompileRuns), on
          the pool beside the observation, so an API read never holds up the round-->
        --apply(result, now, shared) submitted to a pool of threads, in the context of the timer
          call that registered it (kopf's events post as they did from the timer), and not waited
          for: the next tick observes the next due deployments while these write
        an apply that returns: due again an interval after this round; one that raises:
          on_failure, due again after retry_seconds
    a registration whose timer stopped (the deployment deleted, the operator stopping) is dropped

The due time is the scheduler's, not the timer's: a check is observed within one tick of falling
due, whatever the phase of the deployment's timer, and the end of one deployment's status write is
no other deployment's start (docs/operator-scale.md).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Hashable

from shapeshift.operator.prometheus import ObservedTraffic, PrometheusTraffic, SeriesSelector, TrafficQueryError
from shapeshift.operator.prometheus_batch import batch_key, observe_many

__all__ = ["DriftScheduler", "Registration"]

LOG = logging.getLogger(__name__)

Observed = ObservedTraffic | TrafficQueryError | None


@dataclass
class Registration:
    uid: str
    name: str
    interval_seconds: float
    url: str | None
    window_seconds: int
    selector: SeriesSelector
    timeout_seconds: float
    allowed_cidrs: tuple[str, ...]
    # (observed or the error, the check's time, what read_shared gave this round) -> None; raises to
    # give up this check (due again after retry_seconds)
    apply: Callable[[Observed, datetime, Any], None]
    # checks with the same shared_key share one read_shared() per round (the namespace's CompileRuns);
    # what it raises is handed to apply as the value
    shared_key: Hashable = None
    read_shared: Callable[[], Any] | None = None
    last_check: datetime | None = None  # status.drift.lastCheckTime when registered
    stopped: Callable[[], bool] = lambda: False  # the timer's stop flag: True once it will not run again
    context: contextvars.Context = field(default_factory=contextvars.copy_context)

    def group(self) -> tuple[Any, ...]:
        return (self.url, self.window_seconds, self.timeout_seconds, self.allowed_cidrs, batch_key(self.selector))


@dataclass
class _Slot:
    registration: Registration
    due: float  # epoch seconds
    last: float | None  # the round time of its last check that returned
    running: bool = False


class DriftScheduler:
    # A round takes at most this many times the checks that fall due per second on average, times
    # the seconds since the round before (and at least `workers`): the most overdue first.
    HEADROOM = 1.5

    def __init__(self, tick_seconds: float = 1.0, workers: int = 32, retry_seconds: float = 10.0,
                 on_failure: Callable[[Registration, BaseException], None] | None = None):
        self.tick_seconds = tick_seconds
        self.workers = workers
        self._last_round: float | None = None
        self.retry_seconds = retry_seconds
        self.on_failure = on_failure
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.batches = 0  # batched groups observed, for tests

    # ---- the registry ----------------------------------------------------------------------

    def register(self, registration: Registration, start: bool = True) -> None:
        """The deployment's latest registration; its due time stays the scheduler's, except that a
        new checkIntervalSeconds counts from its last check at once."""
        with self._lock:
            slot = self._slots.get(registration.uid)
            if slot is None:
                last = registration.last_check.timestamp() if registration.last_check is not None else None
                due = last + registration.interval_seconds if last is not None else 0.0
                self._slots[registration.uid] = _Slot(registration, due=due, last=last)
            else:
                if slot.registration.interval_seconds != registration.interval_seconds and slot.last is not None:
                    slot.due = slot.last + registration.interval_seconds
                slot.registration = registration
        if start:
            self.start()

    def registered(self) -> int:
        with self._lock:
            return len(self._slots)

    def due_at(self, uid: str) -> float | None:
        """Epoch seconds at which the deployment's next check falls due (None: not registered)."""
        with self._lock:
            slot = self._slots.get(uid)
            return None if slot is None else slot.due

    def running(self) -> int:
        with self._lock:
            return sum(slot.running for slot in self._slots.values())

    # ---- the thread ------------------------------------------------------------------------

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
            while True:
                began = time.monotonic()
                try:
                    self.run_once(pool)
                except Exception:  # noqa: BLE001 - the scheduler outlives one bad tick
                    LOG.exception("drift scheduler tick failed")
                if self._stop.wait(max(0.0, self.tick_seconds - (time.monotonic() - began))):
                    return

    # ---- one round -------------------------------------------------------------------------

    def run_once(self, pool: concurrent.futures.Executor, now: float | None = None) -> list[concurrent.futures.Future]:
        """Observe every due deployment whose previous check has ended and submit its apply to
        ``pool``; the futures of the applies (the round does not wait for them)."""
        clock = time.time() if now is None else now
        with self._lock:
            for uid in [uid for uid, slot in self._slots.items() if not slot.running and slot.registration.stopped()]:
                del self._slots[uid]
            due = sorted((slot for slot in self._slots.values() if not slot.running and slot.due <= clock),
                         key=lambda slot: slot.due)[:self._round_size(clock)]
            self._last_round = clock
            for slot in due:
                slot.running = True
        if not due:
            return []
        at = datetime.fromtimestamp(clock, timezone.utc).replace(microsecond=0)
        groups: dict[tuple[Any, ...], list[_Slot]] = {}
        for slot in due:
            groups.setdefault(slot.registration.group(), []).append(slot)
        shared = self._shared(pool, [slot.registration for slot in due])
        futures = []
        for slots in groups.values():
            registrations = [slot.registration for slot in slots]
            try:
                results = self._observe(registrations, at)
            except Exception as err:  # noqa: BLE001 - observe_many answers errors per deployment; this is a bug
                LOG.exception("batched observation of %d deployments failed", len(slots))
                for slot in slots:
                    self._ended(slot, slot.registration, clock, err)
                continue
            self.batches += 1
            for slot, registration in zip(slots, registrations):
                futures.append(pool.submit(self._check, slot, registration, results.get(registration.uid), at,
                                           shared.get(registration.shared_key), clock))
        return futures

    def _round_size(self, clock: float) -> int:
        """How many checks this round takes (the lock held). Deployments registered together fall
        due together; a round of all of them would queue their applies behind each other for most
        of an interval, so a burst is spread over the next rounds, most overdue first, and stays
        spread: each one's next due time counts from its own round."""
        since = self.tick_seconds if self._last_round is None else max(self.tick_seconds, clock - self._last_round)
        rate = sum(1.0 / slot.registration.interval_seconds for slot in self._slots.values()
                   if slot.registration.interval_seconds > 0)
        return max(self.workers, math.ceil(round(self.HEADROOM * rate * since, 6)))

    def _check(self, slot: _Slot, registration: Registration, observed: Observed, at: datetime,
               shared: concurrent.futures.Future | None, clock: float) -> None:
        """One apply, in its timer call's context, with what its key's read_shared() gave (or
        raised); its slot is free again when the future is done."""
        try:
            if registration.stopped():  # its timer stopped meanwhile (deleted, or the replica paused)
                with self._lock:
                    slot.running = False
                return
            value = None if shared is None else (shared.exception() or shared.result())
            registration.context.run(registration.apply, observed, at, value)
        except BaseException as err:  # noqa: BLE001 - one deployment's failure is its own
            self._ended(slot, registration, clock, err)
            raise
        self._ended(slot, registration, clock, None)

    def _ended(self, slot: _Slot, registration: Registration, clock: float, err: BaseException | None) -> None:
        with self._lock:
            slot.running = False
            if err is None:
                slot.last = clock
                slot.due = clock + slot.registration.interval_seconds
            else:
                slot.due = max(clock, time.time()) + self.retry_seconds  # from the failure
        if err is not None and self.on_failure is not None:
            self.on_failure(registration, err)

    @staticmethod
    def _shared(pool: concurrent.futures.Executor,
                registrations: list[Registration]) -> dict[Hashable, concurrent.futures.Future]:
        """One read_shared() per shared key of the round, submitted to ``pool`` ahead of the round's
        applies (which wait on it; the pool takes work in order, so a waiting apply's read has
        started); what it raises is the value."""
        out: dict[Hashable, concurrent.futures.Future] = {}
        for registration in registrations:
            if registration.read_shared is not None and registration.shared_key not in out:
                out[registration.shared_key] = pool.submit(registration.read_shared)
        return out

    @staticmethod
    def _observe(registrations: list[Registration], now: datetime) -> dict[str, ObservedTraffic | TrafficQueryError]:
        first = registrations[0]
        if not first.url:
            return {}  # apply(None, ...) says why: no Prometheus address
        with PrometheusTraffic(first.url, timeout_seconds=first.timeout_seconds,
                               allowed_cidrs=first.allowed_cidrs) as prom:
            return observe_many(prom, {r.uid: r.selector for r in registrations}, f"{first.window_seconds}s", at=now,
                                names={r.uid: f"{r.name}-observed" for r in registrations})
