"""The drift scheduler's due times and rounds (operator/drift_scheduler.py), without Prometheus:
registrations without an address, so each apply gets None, on a clock the test sets.

A deployment never checked is due at once, one checked before an interval after its
status.drift.lastCheckTime; after a check it is due an interval after the round that observed
it. A round submits its applies and returns without waiting for them: a deployment whose apply
still runs is not observed again, the others are. A failed apply is due again after
retry_seconds; the CompileRuns (read_shared) are read once per namespace per round; a
registration whose timer stopped is dropped. A burst of deployments due at once is spread over the
next rounds, most overdue first, and stays spread.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from datetime import datetime, timezone

import pytest

from shapeshift.operator.drift_scheduler import DriftScheduler, Registration
from shapeshift.operator.prometheus import SeriesSelector

T0 = 1_900_000_000.0


def registration(uid: str, apply, *, interval: float = 20.0, namespace: str = "team-a", last_check=None,
                 read_shared=None, stopped=lambda: False) -> Registration:
    return Registration(uid=uid, name=uid, interval_seconds=interval, url=None, window_seconds=60,
                        selector=SeriesSelector(namespace, uid, "tiny-llama"), timeout_seconds=1.0,
                        allowed_cidrs=(), apply=apply, shared_key=namespace, read_shared=read_shared,
                        last_check=last_check, stopped=stopped)


@pytest.fixture
def pool():
    with concurrent.futures.ThreadPoolExecutor(4) as executor:
        yield executor


def settle(futures) -> None:
    for future in concurrent.futures.as_completed(futures, timeout=10):
        future.exception()


def test_due_times_are_the_schedulers_own(pool):
    checks: list[tuple[str, datetime]] = []
    scheduler = DriftScheduler()
    apply = lambda uid: lambda observed, at, shared: checks.append((uid, at))  # noqa: E731
    scheduler.register(registration("new", apply("new")), start=False)
    scheduler.register(registration("old", apply("old"), last_check=datetime.fromtimestamp(T0 - 5, timezone.utc)),
                       start=False)
    settle(scheduler.run_once(pool, now=T0))
    assert [uid for uid, _ in checks] == ["new"]  # "old" was checked 5 s ago
    assert checks[0][1] == datetime.fromtimestamp(T0, timezone.utc)
    assert scheduler.due_at("new") == T0 + 20 and scheduler.due_at("old") == T0 + 15
    assert scheduler.run_once(pool, now=T0 + 14.9) == []
    settle(scheduler.run_once(pool, now=T0 + 15))
    settle(scheduler.run_once(pool, now=T0 + 20.4))
    assert [uid for uid, _ in checks] == ["new", "old", "new"]
    assert scheduler.due_at("new") == T0 + 40.4
    # a new checkIntervalSeconds counts from the last check at once
    scheduler.register(registration("new", apply("new"), interval=60.0), start=False)
    assert scheduler.due_at("new") == T0 + 80.4


def test_a_round_does_not_wait_for_its_applies_and_a_running_check_is_not_observed_again(pool):
    release = threading.Event()
    checked: list[str] = []

    def slow(observed, at, shared):
        release.wait(10)
        checked.append("slow")

    scheduler = DriftScheduler()
    scheduler.register(registration("slow", slow), start=False)
    first = scheduler.run_once(pool, now=T0)
    assert len(first) == 1 and not first[0].done()  # the round returned with the apply still running
    assert scheduler.running() == 1
    scheduler.register(registration("quick", lambda observed, at, shared: checked.append("quick")), start=False)
    settle(scheduler.run_once(pool, now=T0 + 30))  # "slow" is overdue but still applying
    assert checked == ["quick"]
    release.set()
    settle(first)
    assert scheduler.running() == 0
    assert scheduler.due_at("slow") == T0 + 20  # an interval after the round that observed it


def test_a_failed_check_is_due_again_after_retry_seconds(pool):
    failures = []

    def broken(observed, at, shared):
        raise RuntimeError("API down")

    scheduler = DriftScheduler(retry_seconds=7.0, on_failure=lambda r, err: failures.append((r.uid, str(err))))
    scheduler.register(registration("broken", broken), start=False)
    settle(scheduler.run_once(pool, now=T0))
    assert failures == [("broken", "API down")]
    assert scheduler.due_at("broken") == T0 + 7.0


def test_compile_runs_are_read_once_per_namespace_per_round_and_a_failed_read_is_each_checks(pool):
    reads: list[str] = []
    got: dict[str, object] = {}

    def reader(namespace):
        def read():
            reads.append(namespace)
            if namespace == "team-b":
                raise RuntimeError("forbidden")
            return [f"{namespace}-run"]
        return read

    def apply(uid):
        def run(observed, at, shared):
            got[uid] = shared
        return run

    scheduler = DriftScheduler()
    for uid, namespace in (("a1", "team-a"), ("a2", "team-a"), ("a3", "team-a"), ("b1", "team-b")):
        scheduler.register(registration(uid, apply(uid), namespace=namespace, read_shared=reader(namespace)),
                           start=False)
    settle(scheduler.run_once(pool, now=T0))
    assert sorted(reads) == ["team-a", "team-b"]
    assert got["a1"] == got["a2"] == got["a3"] == ["team-a-run"]
    assert isinstance(got["b1"], RuntimeError)


def test_a_slow_compile_runs_read_does_not_hold_up_the_round(pool):
    release = threading.Event()
    got: dict[str, object] = {}

    def slow_read():
        release.wait(10)
        return ["team-a-run"]

    scheduler = DriftScheduler()
    scheduler.register(registration("a1", lambda observed, at, shared: got.update(a1=shared),
                                    read_shared=slow_read), start=False)
    scheduler.register(registration("b1", lambda observed, at, shared: got.update(b1=shared), namespace="team-b",
                                    read_shared=lambda: []), start=False)
    began = time.monotonic()
    futures = scheduler.run_once(pool, now=T0)
    assert time.monotonic() - began < 5 and len(futures) == 2  # the round returned with the read still going
    futures[1].result(timeout=10)
    assert got == {"b1": []} and not futures[0].done()  # the other namespace's check did not wait for it
    release.set()
    settle(futures)
    assert got == {"a1": ["team-a-run"], "b1": []}


def test_a_stopped_registration_is_dropped(pool):
    stopped = threading.Event()
    scheduler = DriftScheduler()
    scheduler.register(registration("gone", lambda *args: None, stopped=stopped.is_set), start=False)
    assert scheduler.registered() == 1
    stopped.set()
    assert scheduler.run_once(pool, now=T0) == []
    assert scheduler.registered() == 0


def test_the_thread_checks_a_registered_deployment_within_a_tick():
    done = threading.Event()
    scheduler = DriftScheduler(tick_seconds=0.05)
    scheduler.register(registration("now", lambda observed, at, shared: done.set()))
    try:
        assert done.wait(5)
    finally:
        scheduler.stop()



def test_a_burst_is_spread_over_rounds_most_overdue_first_and_stays_spread(pool):
    checked: dict[str, list[float]] = {}
    scheduler = DriftScheduler(workers=2)

    def apply(uid):
        def run(observed, at, shared):
            checked.setdefault(uid, []).append(at.timestamp())
        return run

    for index in range(40):  # 40 deployments every 20 s: 2 a second on average, rounds of at most 3
        last = datetime.fromtimestamp(T0 - 20 - index / 10, timezone.utc)  # d39 the most overdue
        scheduler.register(registration(f"d{index:02d}", apply(f"d{index:02d}"), last_check=last), start=False)
    first = scheduler.run_once(pool, now=T0)
    settle(first)
    assert sorted(checked) == ["d37", "d38", "d39"]
    for second in range(1, 60):
        settle(scheduler.run_once(pool, now=T0 + second))
    per_round: dict[float, int] = {}
    for times in checked.values():
        for at in times:
            per_round[at] = per_round.get(at, 0) + 1
    assert max(per_round.values()) <= 3
    assert all(len(checked[f"d{index:02d}"]) >= 2 for index in range(40))
    # the burst took 14 rounds (40 at 3 a round) and stays spread: every later gap is the interval
    assert max(times[0] for times in checked.values()) == T0 + 13
    gaps = [b - a for times in checked.values() for a, b in zip(times, times[1:])]
    assert gaps and max(gaps) == min(gaps) == 20
