"""The verifier's start-up self-test: the short corpus passes on working gates, and a corpus
whose "bad" candidate is in fact correct (as gates that stopped working would see every bad
one) fails it with a message that says which candidate got through which gate."""

from __future__ import annotations

from shapeshift.engine.verify.selftest import SHORT_CORPUS, run_self_test


def test_short_corpus_passes_on_working_gates():
    report = run_self_test()
    assert report.passed, report.message()
    assert {r["candidate"] for r in report.results} == set(SHORT_CORPUS)
    assert all(r.get("reason") for r in report.results if r["gate"])
    assert report.seconds < 30  # the corpus; starting the zygote is apart (startup_s, once a worker)
    assert report.startup_s >= 0 and "candidate processes ready in" in report.message()


def test_a_bad_candidate_getting_through_fails_the_self_test():
    good_source = SHORT_CORPUS["stock_with_a_comment"][0]
    report = run_self_test({"claimed_bad": (good_source, "outputs.agreement"),
                            "stock_with_a_comment": SHORT_CORPUS["stock_with_a_comment"]})
    assert not report.passed
    assert report.failures == ["claimed_bad was not rejected by outputs.agreement"]
    assert report.message().startswith("verification self-test failed, nothing will be published: claimed_bad")
