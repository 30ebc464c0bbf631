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
    for r in report.results:
        print(f"{r['candidate']}: {r['gate'] or 'passes'}: {r.get('reason') or 'passed'}")
    assert report.seconds < 30  # the corpus; starting the zygote is apart (startup_s, once a worker)
    assert report.startup_s >= 0 and "candidate processes ready in" in report.message()


def test_a_bad_candidate_getting_through_fails_the_self_test():
    good_source = SHORT_CORPUS["stock_with_a_comment"][0]
    report = run_self_test({"claimed_bad": (good_source, "outputs.agreement"),
                            "stock_with_a_comment": SHORT_CORPUS["stock_with_a_comment"]})
    assert not report.passed
    assert report.failures == ["claimed_bad was not rejected by outputs.agreement"]
    assert report.message().startswith("verification self-test failed, nothing will be published: claimed_bad")


class _CompileRunStatus:
    """The CustomObjectsApi calls CompileRunContext makes, recorded (no API server)."""

    def __init__(self) -> None:
        self.patches: list[dict] = []

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body):
        self.patches.append({"plural": plural, "name": name, **body})


def test_a_worker_whose_self_test_fails_publishes_nothing_and_says_why(tmp_path, monkeypatch):
    """cli.run, the compile worker's entry, runs the self-test first: with a gate that stopped
    working (outputs.agreement passes everything) a known-bad candidate gets through, the worker
    returns 3 before it builds an evaluator, and the CompileRun's status says why."""
    from shapeshift.engine.compile import cli
    from shapeshift.engine.compile.job import CompileJob, JobRequest
    from shapeshift.engine.compile.worker import CompileRunContext
    from shapeshift.engine.forward_pass import patch_guard
    from shapeshift.engine.verify import anticheat, gates, selftest

    patch_guard.capture_harness(anticheat.HARNESS_MODULES)  # the real gates are the reference, not the stand-in
    monkeypatch.setattr(gates, "gate_agreement", lambda ctx: {"compared": "nothing"})
    monkeypatch.setattr(selftest, "SHORT_CORPUS", {n: SHORT_CORPUS[n] for n in ("reversed_logits", "stock_with_a_comment")})

    def past_the_self_test(*args, **kwargs):
        raise AssertionError("the worker went on past a failed self-test")

    monkeypatch.setattr(cli, "build_evaluator", past_the_self_test)
    for step in ("publish", "finish", "store_artifact", "pass_to_beat"):
        monkeypatch.setattr(CompileRunContext, step, past_the_self_test)
    cluster = CompileRunContext.__new__(CompileRunContext)  # its API calls recorded, not sent
    cluster.custom, cluster.namespace, cluster.name = _CompileRunStatus(), "team", "run-1"
    out = tmp_path / "out"
    assert cli.run(CompileJob.from_request(JobRequest(out=str(out), use_registry=False)), cluster) == 3
    [patch] = cluster.custom.patches
    assert patch["plural"] == "compileruns" and patch["name"] == "run-1"
    assert patch["status"]["message"] == ("compile worker failed: verification self-test failed, nothing will be "
                                          "published: reversed_logits was not rejected by outputs.agreement")
    assert not (out / "champion").exists() and not (out / "board.jsonl").exists()
