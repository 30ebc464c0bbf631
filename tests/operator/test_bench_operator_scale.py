"""hack/bench_operator_scale.py's lag of drift checks: the time between consecutive checks of one
deployment over its interval, with a deployment that falls behind or is never checked counted,
and the checks read from Prometheus's query log. (The benchmark itself is run by hand.)"""

from __future__ import annotations

import json

import pytest

from harness.scripts import load_hack_script

bench = load_hack_script("bench_operator_scale")


def test_gaps_between_checks_over_the_interval():
    checks = {"a": [0.0, 20.0, 41.0, 60.0], "b": [5.0, 25.0, 55.0]}
    lags = bench.check_lags(checks, ["a", "b"], 20.0, start=10.0, end=60.0)
    # a: 20, 21, 19 (the check at 0 is before the window; its gap to 20 counts); b: 20, 30
    assert sorted(lags.ratios) == pytest.approx([0.95, 1.0, 1.0, 1.05, 1.5])
    assert lags.checks == 5 and lags.unchecked == [] and lags.max == pytest.approx(1.5)
    assert lags.quantile(0.5) == pytest.approx(1.0) and lags.quantile(0.99) == pytest.approx(1.5)


def test_a_deployment_that_falls_behind_or_is_never_checked_counts():
    checks = {"late": [0.0, 20.0], "never": [], "fine": [40.0, 60.0, 80.0, 100.0]}
    lags = bench.check_lags(checks, ["late", "never", "fine"], 20.0, start=50.0, end=100.0)
    # late: no check in the window, last one 80 s before its end; never: at least the window
    assert lags.unchecked == ["late", "never"]
    assert lags.max == pytest.approx(80 / 20) and 50 / 20 in lags.ratios
    # still waiting at the end, past its interval
    overdue = bench.check_lags({"x": [0.0, 20.0, 40.0]}, ["x"], 20.0, start=10.0, end=75.0)
    assert overdue.max == pytest.approx(35 / 20)
    assert bench.check_lags({}, [], 20.0, 0.0, 1.0).max is None


def test_checks_are_read_from_the_query_log(tmp_path):
    log = tmp_path / "queries.jsonl"
    entries = [
        {"params": {"query": 'sum(increase(shapeshift_prompt_tokens_count{namespace="scale",deployment="d0001",'
                             'model="tiny-llama"}[1m]))'}, "ts": "2026-12-02T01:00:00.123456789Z"},
        {"params": {"query": 'sum(rate(shapeshift_prefix_cache_hits_tokens_total{deployment="d0001"}[1m]))'},
         "ts": "2026-12-02T01:00:00.2Z"},
        {"params": {"query": 'sum(increase(shapeshift_prompt_tokens_count{namespace="scale",deployment="d0001",'
                             'model="tiny-llama"}[1m]))'}, "ts": "2026-12-02T01:00:20.123456Z"},
    ]
    log.write_text("\n".join(json.dumps(e) for e in entries) + "\nnot json\n")
    checks = bench.drift_checks(log)
    assert list(checks) == ["d0001"] and checks["d0001"][1] - checks["d0001"][0] == pytest.approx(20.0)
    start = checks["d0001"][0] - 1
    assert bench.query_log_counts(log, start, start + 2) == (2, 1)


def test_batched_checks_count_for_each_deployment_of_the_batch(tmp_path):
    """The drift scheduler's batched query (operator/prometheus_batch.py) is a check of each of its deployments."""
    from shapeshift.operator.prometheus import SeriesSelector, traffic_queries, window_span
    from shapeshift.operator.prometheus_batch import batch_matcher

    selectors = [SeriesSelector("scale", name, "tiny-llama") for name in ("d0001", "d0002", "d.3")]
    query = traffic_queries(batch_matcher(selectors), window_span("60s"),
                            by=("namespace", "deployment", "model"))["requests"]
    log = tmp_path / "queries.jsonl"
    log.write_text(json.dumps({"params": {"query": query}, "ts": "2026-12-02T01:00:00Z"}) + "\n")
    assert sorted(bench.drift_checks(log)) == ["d.3", "d0001", "d0002"]
    start = bench.drift_checks(log)["d0001"][0] - 1
    assert bench.query_log_counts(log, start, start + 2) == (1, 3)


def test_status_writes_count_each_new_check_time_once():
    writes = bench.StatusWrites(None, "scale", start=False)

    def obj(name, last):
        return {"metadata": {"name": name}, "status": {"drift": {"lastCheckTime": last}} if last else {}}

    writes.seen(obj("d0001", None), 99.0)  # not checked yet
    writes.seen(obj("d0001", "2026-12-02T01:00:00Z"), 100.0)
    writes.seen(obj("d0001", "2026-12-02T01:00:00Z"), 103.0)  # another writer's event, same check
    writes.seen(obj("d0001", "2026-12-02T01:00:20Z"), 125.0)
    assert writes.received() == {"d0001": [100.0, 125.0]}
    base = bench._epoch("2026-12-02T01:00:00Z")
    assert [at for _, at in writes.writes["d0001"]] == [base, base + 20]
    # observation to write, for the quantiles the result reports (nearest rank, as the check lags')
    assert writes.delays(100.0, 125.0) == [100.0 - base, 125.0 - base - 20]
    assert bench.nearest_rank([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and bench.nearest_rank([1.0, 2.0], 0.99) == 2.0
    assert bench.nearest_rank([], 0.5) is None

