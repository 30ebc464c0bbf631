"""The regime library on the real control plane, with a real Prometheus and the operator in-process.

An InferenceDeployment (policy OnDrift, drift and switches after two checks, no cooldowns until the
last leg) whose status says its forward pass was compiled for very short prompts; its engine's
series come from tests/drift/metrics_exporter.py (the engine's EngineMetrics, real observations)
scraped by Prometheus.

    traffic A (prompts ~100 tokens)  -> a CompileRun for regime A; its champion fp-a is published as
                                        a compile worker publishes it (the run vouches for it), the
                                        Job's pod exits 0 (a stand-in worker run by the harness's
                                        kubelet), and fp-a is recorded in status.regimes; the run's
                                        status.economics (and the champion's) against a hand
                                        calculation from the Job's real times and the served rate
                                        asked of Prometheus again; `kubectl get compileruns` shows them,
                                        `kubectl get infd -o wide` the current regime's; with a 5 s
                                        refresh, more A traffic: saved and payback read again (run and
                                        library), spent unchanged
    traffic B (prompts ~600 tokens)  -> a CompileRun for regime B; fp-b written by hand (no run vouches
                                        for it) is not recorded; published by the run, it is
    traffic A again                  -> a switch to fp-a within two checks, no CompileRun, an event
                                        RegimeSwitched and the condition Regime saying why; the
                                        rollout's target is fp-a (status.rollout.desired)
    B for one check, then A          -> inside the hysteresis: no switch, no CompileRun
    traffic C (prompts ~1800 tokens) -> with spec.compilation.maxPaybackHours below what the compiles
      with a payback limit              so far take to pay back: no CompileRun, the condition Regime
                                        says why (PaybackTooLong, the expected payback by hand)
    B, A, B, one check each          -> with spec.regimes.switchCooldownSeconds an hour (set during C)
      (flapping, each settled:          and switchChecks 1, B's checks would switch to fp-b: no switch
      switchChecks 1)                   (fp-a and its switch time stay, one RegimeSwitched event in
                                        all), no CompileRun, the visits counted in status.regimes, the
                                        condition Regime SwitchCoolingDown saying when the next switch
                                        is allowed (an hour after the switch to fp-a)

Each phase sends more requests than the Prometheus window still holds from the one before, so the
window's median is the new phase's.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta

import pytest

from drift.metrics_exporter import exporter_process, observe
from harness.cluster import wait_until

os.environ.setdefault("SHAPESHIFT_DRIFT_TIMER_SECONDS", "2")  # only effective if imported first

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
NAME = "llama"
KEY_A, KEY_B, KEY_C = "p0-h0-c0-o0", "p1-h0-c0-o0", "p2-h0-c0-o0"
SPEEDUP, BASELINE = 1.3, 100.0  # the champions' measured speedup and baseline output tokens/s (one accelerator)


@pytest.fixture
def engine_metrics():
    with exporter_process("tiny-llama") as target:
        yield target


def send(target: str, count: int, low: int, high: int) -> None:
    """``count`` finished requests with prompts spread over [low, high) tokens, no prefix hits
    (one exporter call per prompt length, with the requests of that length)."""
    lengths = Counter(low + (i * 37) % (high - low) for i in range(count))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: observe(target, item[0], 16, 0, count=item[1]), lengths.items()))


def stand_in_worker(folder) -> str:
    """A PATH whose `shapeshift` exits 0 at once: the compile pod's command line, run locally."""
    folder.mkdir()
    script = folder / "shapeshift"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.exit(0)\n")
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ['PATH']}"


def test_traffic_back_in_a_known_regime_switches_to_its_champion_without_compiling(
        crds, namespace, engine_metrics, prometheus, monkeypatch, run_pod_locally, tmp_path):
    from kopf.testing import KopfRunner

    from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile
    from shapeshift.operator.api import COMPILE_RUN_UID_ANNOTATION, ForwardPassSpec

    custom = crds.custom
    server = prometheus([{
        "job_name": "engine", "scrape_interval": "1s", "scrape_timeout": "1s",
        "static_configs": [{"targets": [engine_metrics], "labels": {"namespace": namespace, "deployment": NAME}}],
    }])
    server.wait_for(f'shapeshift_prompt_tokens_count{{namespace="{namespace}"}}', timeout_s=30)
    send(engine_metrics, 40, 90, 120)  # regime A
    server.wait_for(f'sum(shapeshift_prompt_tokens_count{{namespace="{namespace}"}})', lambda v: v >= 40)

    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {
            "model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, "replicas": 1,
            "engine": {"dtype": "float32"}, "prometheusUrl": server.url,
            "compilation": {"policy": "OnDrift", "cooldownSeconds": 0,
                            "drift": {"consecutiveChecks": 2, "checkIntervalSeconds": 10, "windowSeconds": 60}},
            "regimes": {"switchChecks": 2, "switchCooldownSeconds": 0},
        },
    })
    tiny = TrafficProfile(name="tiny", prompt_length=LengthDistribution(p50=12, p90=14, p99=16),
                          output_length=LengthDistribution(p50=16, p90=16, p99=16), prefix_cache_hit_rate=0.0)
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "inferencedeployments", NAME,
                                                 {"status": {"compiledFor": tiny.to_dict()}})

    def idep() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", NAME)

    def runs() -> list[dict]:
        return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]

    def regime(name: str) -> dict:
        return next((r for r in (idep().get("status") or {}).get("regimes") or [] if r["name"] == name), {})

    def current() -> dict:
        return (idep().get("status") or {}).get("currentRegime") or {}

    def observing(key: str) -> dict | None:
        """The deployment, if its last check observed regime ``key``."""
        body = idep()
        return body if ((body.get("status") or {}).get("currentRegime") or {}).get("observed") == key else None

    worker_path = stand_in_worker(tmp_path / "stand-in")

    def publish(run: dict, champion: str, sha256: str, vouched: bool = True, finish: bool = True) -> None:
        """fp-X as a compile worker publishes it: the run's uid on the pass, the pass's name and spec
        digest in the run's status; then (``finish``) the worker exits 0, so that the Job completes
        and the operator moves the run to Succeeded with the Job's completion time."""
        name = run["metadata"]["name"]

        def stored_status() -> dict:
            return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", name).get("status") or {}

        # the worker finishes after the operator saw its pod run (the Job's start time in the run's status)
        wait_until(lambda: stored_status().get("phase") in ("Running", "Succeeded") and stored_status().get("startTime"),
                   timeout_s=60, what="the CompileRun's pod running")
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass",
                "metadata": {"name": champion,
                             "annotations": {COMPILE_RUN_UID_ANNOTATION: run["metadata"]["uid"]} if vouched else {}},
                "spec": {"model": {"name": "tiny-llama", "dtype": "float32"}, "hardware": {"accelerator": "cpu"},
                         "traffic": run["spec"]["traffic"]["inline"],
                         "artifact": {"uri": f"/var/lib/shapeshift-artifacts/{sha256}.tar.gz", "sha256": sha256},
                         "metrics": {"speedup": SPEEDUP, "baselineTokensPerSecond": BASELINE,
                                     "tokensPerSecond": BASELINE * SPEEDUP},
                         "verification": {"passed": True, "gates": [{"name": "greedy-match", "passed": True}],
                                          "artifactSha256": sha256},
                         "compileRun": f"{namespace}/{run['metadata']['name']}"}}
        stored = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", body)
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "compileruns", name, {
            "status": {"champion": champion,
                       "championSpecSha256": ForwardPassSpec.model_validate(stored["spec"]).digest()}})
        if finish:
            pod = wait_until(lambda: [p for p in crds.core.list_namespaced_pod(
                namespace, label_selector=f"shapeshift.dev/compile-run={name}").items if p.spec.node_name],
                timeout_s=30, what="the compile pod")[0]
            run_pod_locally(namespace, pod.metadata.name, extra_env={"PATH": worker_path}, timeout_s=60)
        wait_until(lambda: stored_status().get("phase") == "Succeeded" and stored_status().get("completionTime"),
                   timeout_s=30, what=f"CompileRun {name} Succeeded")

    monkeypatch.setenv("KUBECONFIG", str(crds.kubeconfig))
    import shapeshift.operator.handlers  # noqa: F401
    from shapeshift.operator.handlers import drift as drift_handlers  # registers the timer

    tick = drift_handlers.TIMER_SECONDS
    args = ["run", "--standalone", "--namespace", namespace,
            "-m", "shapeshift.operator.handlers", "-m", "shapeshift.operator.handlers.drift"]
    with KopfRunner(args, timeout=120) as runner:
        # A: compiled, its champion recorded
        run_a = wait_until(lambda: runs() or None, timeout_s=60 + 2 * tick, what="the CompileRun of regime A")
        assert len(run_a) == 1 and run_a[0]["metadata"]["annotations"]["shapeshift.dev/regime"] == KEY_A
        send(engine_metrics, 40, 90, 120)  # A is still served while its compile finishes
        publish(run_a[0], "fp-a", "a" * 64)
        recorded = wait_until(lambda: regime(KEY_A).get("champion"), timeout_s=30 + 2 * tick,
                              what="fp-a recorded as regime A's champion")
        assert recorded["forwardPass"] == "fp-a" and recorded["sha256"] == "a" * 64
        assert recorded["speedup"] == SPEEDUP and recorded["accelerator"] == "cpu"
        assert recorded["compileRun"] == run_a[0]["metadata"]["name"]
        # economics by hand. Spent: one accelerator x the wall time of the real Job (the Job controller's
        # times). Saved: the served output tokens/s, asked of Prometheus again at the time the operator
        # asked it, keep rate / BASELINE accelerators busy at the old speed (at most the one serving
        # accelerator), rate / BASELINE / SPEEDUP at the new one
        run_name = run_a[0]["metadata"]["name"]
        econ = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", run_name)["status"]["economics"]
        job = crds.batch.read_namespaced_job(f"{run_name}-compile", namespace).status
        wall = (job.completion_time - job.start_time).total_seconds()
        assert econ["accelerators"] == 1 and wall > 0 and econ["acceleratorSeconds"] == pytest.approx(wall)
        measured_at = datetime.fromisoformat(econ["measuredAt"].replace("Z", "+00:00"))
        rate = float(server.api("query", time=measured_at.timestamp(), query=(
            f'sum(rate(shapeshift_generated_tokens_total{{namespace="{namespace}",deployment="{NAME}"}}[60s]))'
        ))["result"][0]["value"][1])
        assert rate > 0 and econ["servedTokensPerSecond"] == pytest.approx(rate, rel=0.02)
        busy = min(1.0, rate / BASELINE)
        saved_per_second = busy - busy / SPEEDUP
        assert econ["savedAcceleratorHoursPerDay"] == pytest.approx(24 * saved_per_second, rel=0.02)
        assert econ["paybackHours"] == pytest.approx(wall / saved_per_second / 3600, rel=0.02)
        # the champion in the library says the same, in seconds
        assert recorded["compileAcceleratorSeconds"] == econ["acceleratorSeconds"]
        assert recorded["savedAcceleratorSecondsPerHour"] == pytest.approx(econ["savedAcceleratorHoursPerDay"] * 150, abs=1e-3)
        assert recorded["paybackSeconds"] == pytest.approx(econ["paybackHours"] * 3600, abs=1e-2)
        header, row = crds.kubectl("get", "compileruns", run_name, "-n", namespace).stdout.splitlines()[:2]
        starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]  # cells may be empty: cut by the header
        columns = {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, starts[1:])}
        assert float(columns["SPENT"]) == pytest.approx(econ["acceleratorSeconds"], rel=1e-3)
        assert float(columns["PAYBACK"]) == pytest.approx(econ["paybackHours"], rel=1e-3)
        # and `kubectl get infd -o wide` the current regime (A) and its champion's
        header, row = crds.kubectl("get", "infd", NAME, "-n", namespace, "-o", "wide").stdout.splitlines()[:2]
        starts = [m.start() for m in re.finditer(r"\S+", header)] + [None]
        columns = {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, starts[1:])}
        assert columns["REGIME"] == KEY_A, columns
        assert float(columns["SAVED/DAY"]) == pytest.approx(econ["savedAcceleratorHoursPerDay"], rel=1e-3)
        assert float(columns["PAYBACK"]) == pytest.approx(econ["paybackHours"], rel=1e-3)

        # the saved figure follows the load: with a 5 s refresh, a later check reads the served rate
        # again (more A traffic now) and rewrites saved and payback, in the run and in the library; spent stays
        assert recorded["savingsMeasuredAt"] == econ["measuredAt"]
        monkeypatch.setenv("SHAPESHIFT_SAVINGS_REFRESH_SECONDS", "5")
        send(engine_metrics, 80, 90, 120)
        fresh = wait_until(lambda: (lambda c: c if c and c.get("savingsMeasuredAt") != recorded["savingsMeasuredAt"]
                                    else None)(regime(KEY_A).get("champion")), timeout_s=30 + 4 * tick,
                           what="regime A's savings read again")
        monkeypatch.setenv("SHAPESHIFT_SAVINGS_REFRESH_SECONDS", "1000000")
        again = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", run_name)["status"]["economics"]
        assert again["measuredAt"] == fresh["savingsMeasuredAt"] and again["measuredAt"] > econ["measuredAt"]
        assert again["acceleratorSeconds"] == econ["acceleratorSeconds"]
        measured_at = datetime.fromisoformat(again["measuredAt"].replace("Z", "+00:00"))
        rate = float(server.api("query", time=measured_at.timestamp(), query=(
            f'sum(rate(shapeshift_generated_tokens_total{{namespace="{namespace}",deployment="{NAME}"}}[60s]))'
        ))["result"][0]["value"][1])
        assert again["servedTokensPerSecond"] == pytest.approx(rate, rel=0.02)
        assert again["servedTokensPerSecond"] != econ["servedTokensPerSecond"]
        busy = min(1.0, rate / BASELINE)
        saved_per_second = busy - busy / SPEEDUP
        assert again["savedAcceleratorHoursPerDay"] == pytest.approx(24 * saved_per_second, rel=0.02)
        assert again["paybackHours"] == pytest.approx(wall / saved_per_second / 3600, rel=0.02)
        assert fresh["savedAcceleratorSecondsPerHour"] == pytest.approx(again["savedAcceleratorHoursPerDay"] * 150,
                                                                         abs=1e-3)
        assert fresh["paybackSeconds"] == pytest.approx(again["paybackHours"] * 3600, abs=1e-2)
        assert fresh["compileAcceleratorSeconds"] == recorded["compileAcceleratorSeconds"]

        # B: compiled, its champion recorded
        send(engine_metrics, 100, 550, 700)
        run_b = wait_until(lambda: [r for r in runs() if r["metadata"]["name"] != run_a[0]["metadata"]["name"]],
                           timeout_s=60 + 4 * tick, what="the CompileRun of regime B")
        assert len(run_b) == 1 and run_b[0]["metadata"]["annotations"]["shapeshift.dev/regime"] == KEY_B
        assert 512 < run_b[0]["spec"]["traffic"]["inline"]["promptLength"]["p50"] <= 1024
        assert len(runs()) == 2  # no second run for A while its champion waited to be rolled out
        # first as anyone allowed to create ForwardPasses writes it: without the run's uid on it, the
        # run's word is not the pass's, and the library records nothing
        send(engine_metrics, 20, 550, 700)
        publish(run_b[0], "fp-b", "b" * 64, vouched=False)
        checked = (idep()["status"].get("drift") or {}).get("lastCheckTime")
        wait_until(lambda: (idep()["status"].get("drift") or {}).get("lastCheckTime") != checked,
                   timeout_s=20 + 2 * tick, what="a drift check after the hand-written fp-b")
        assert not regime(KEY_B).get("champion")
        # then as the run's worker publishes it
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", "fp-b")
        wait_until(lambda: not any(fp["metadata"]["name"] == "fp-b" for fp in custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, "forwardpasses")["items"]), timeout_s=20, what="fp-b deleted")
        publish(run_b[0], "fp-b", "b" * 64, finish=False)
        wait_until(lambda: regime(KEY_B).get("champion"), timeout_s=30 + 2 * tick, what="fp-b recorded for B")
        assert current()["name"] == KEY_B

        # back to A: a switch to fp-a within two checks, no CompileRun
        send(engine_metrics, 250, 90, 120)
        switched = wait_until(lambda: current().get("forwardPass") == "fp-a" and current(),
                              timeout_s=40 + 4 * tick, what="the switch back to fp-a")
        assert switched["name"] == KEY_A and switched["sha256"] == "a" * 64 and "no CompileRun" in switched["reason"]
        assert len(runs()) == 2
        conditions = {c["type"]: c for c in idep()["status"]["conditions"]}
        assert conditions["Regime"]["status"] == "True"
        assert conditions["Regime"]["reason"] == "SwitchedToChampion" and "fp-a" in conditions["Regime"]["message"]
        desired = wait_until(lambda: ((idep()["status"].get("rollout") or {}).get("desired") or {}).get("name")
                             == "fp-a", timeout_s=30, what="the rollout's target fp-a")
        assert desired

        # B for one check only, then A again: inside the hysteresis, nothing switches
        last_switch = switched["lastSwitchTime"]
        send(engine_metrics, 700, 550, 700)
        blip = wait_until(lambda: current().get("observed") == KEY_B and current(), timeout_s=30 + 4 * tick,
                          what="one check observing B")
        send(engine_metrics, 1500, 90, 120)
        assert blip["observedChecks"] == 1 and blip["forwardPass"] == "fp-a"
        wait_until(lambda: current().get("observed") == KEY_A and current(), timeout_s=30 + 4 * tick,
                   what="the next check observing A again")

        # C, a new regime, with a payback limit far below what the compiles so far take to pay back
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", NAME,
                                              {"spec": {"compilation": {"maxPaybackHours": 0.001}}})
        send(engine_metrics, 3000, 1600, 2000)
        after = wait_until(lambda: current().get("observed") == KEY_C and current(), timeout_s=30 + 4 * tick,
                           what="a check observing C")
        # the check after the blip's: still A's champion, no switch
        assert (after["name"], after["forwardPass"], after["lastSwitchTime"]) == (KEY_A, "fp-a", last_switch)
        # the switch cooldown of the last leg, an hour (the leg takes well under a minute), and a switch
        # on the first check in a regime, so that only the cooldown can hold a switch there. Set now, a
        # check before the leg's traffic: the operator's drift registration takes the spec at its next
        # timer tick, and C has no champion, so neither setting changes what C's checks decide
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", NAME,
                                              {"spec": {"regimes": {"switchChecks": 1, "switchCooldownSeconds": 3600}}})
        skipped = wait_until(lambda: next((c for c in idep()["status"]["conditions"] if c["type"] == "Regime"
                                           and c["reason"] == "PaybackTooLong"), None),
                             timeout_s=30 + 4 * tick, what="the condition Regime saying PaybackTooLong")
        # by hand: the mean spent over the mean saved of the champions recorded with their economics
        costs = [r["champion"] for r in idep()["status"]["regimes"] if (r.get("champion") or {}).get(
            "savedAcceleratorSecondsPerHour")]
        assert costs and skipped["status"] == "False"
        expected = (sum(c["compileAcceleratorSeconds"] for c in costs)
                    / (sum(c["savedAcceleratorSecondsPerHour"] for c in costs) / 3600))
        assert expected > 0.001 * 3600
        assert (f"traffic settled in a new regime {KEY_C}" in skipped["message"] and
                f"not compiled: the expected payback of a compile, {expected / 3600:.2f} h, is longer than "
                "spec.compilation.maxPaybackHours 0.001 h" in skipped["message"]), skipped
        assert len(runs()) == 2 and not regime(KEY_C).get("compileRun")

        # flapping between A and B, each settled on its check, inside the cooldown of the switch to fp-a:
        # B would switch to fp-b without the cooldown; no switch, no CompileRun, the condition says why
        until = (datetime.fromisoformat(last_switch.replace("Z", "+00:00")) + timedelta(seconds=3600)).isoformat()
        visits = {key: regime(key)["visits"] for key in (KEY_A, KEY_B)}
        prompts = f'sum(shapeshift_prompt_tokens_count{{namespace="{namespace}"}})'
        # each phase outnumbers what the window still holds on the other side of the median
        for key, count, low, high in [(KEY_B, 6000, 550, 700), (KEY_A, 15000, 90, 120), (KEY_B, 20000, 550, 700)]:
            sent = float(server.query(prompts)[0]["value"][1]) + count
            send(engine_metrics, count, low, high)
            server.wait_for(prompts, lambda v: v >= sent)  # scraped before the next check reads the window
            seen = wait_until(lambda: observing(key), timeout_s=20 + 2 * tick, what=f"a check observing {key}")
            now, held = seen["status"]["currentRegime"], {c["type"]: c for c in seen["status"]["conditions"]}["Regime"]
            assert (now["forwardPass"], now["sha256"], now["lastSwitchTime"]) == ("fp-a", "a" * 64, last_switch), now
            if key == KEY_B:
                assert (held["status"], held["reason"]) == ("False", "SwitchCoolingDown"), held
                assert (f"traffic settled in regime {KEY_B} (champion fp-b); next switch allowed after {until} "
                        "(spec.regimes.switchCooldownSeconds)" == held["message"]), held
            else:  # back in A, whose champion is served: nothing to switch, so nothing the cooldown holds
                assert (held["reason"], held["message"]) == (
                    "InRegime", f"traffic back in regime {KEY_A}, its champion fp-a is served"), held
        assert (regime(KEY_A)["visits"], regime(KEY_B)["visits"]) == (visits[KEY_A] + 1, visits[KEY_B] + 2)
        assert len(runs()) == 2
        assert (regime(KEY_A)["compileRun"], regime(KEY_B)["compileRun"]) == (
            run_a[0]["metadata"]["name"], run_b[0]["metadata"]["name"])
        assert ((idep()["status"].get("rollout") or {}).get("desired") or {}).get("name") == "fp-a"
    assert runner.exception is None, runner.output[-4000:]
    events = [e for e in crds.core.list_namespaced_event(namespace).items
              if e.involved_object.kind == "InferenceDeployment"]
    reasons = [e.reason for e in events]
    # one switch in all, the one to fp-a the cooldown leg's hour counts from
    assert reasons.count("RegimeSwitched") == 1 and reasons.count("CompileRunCreated") == 2, reasons
    assert reasons.count("RegimeChampionRecorded") == 2, reasons
    message = next(e.message for e in events if e.reason == "RegimeSwitched")
    assert "fp-a" in message and KEY_A in message


def test_the_api_server_holds_the_regime_pins_to_their_rules(crds, namespace):
    """spec.regimes' CEL rules: each regime pinned once; spec.forwardPass and spec.regimes.pin not both."""
    from kubernetes.client import ApiException

    def create(name: str, **spec) -> None:
        crds.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": {"model": {"preset": "tiny-llama"}, "hardware": {"accelerator": "cpu"}, **spec}})

    create("pinned", regimes={"pin": KEY_A, "champions": [{"regime": KEY_A, "forwardPass": "fp-a"},
                                                         {"regime": KEY_B, "forwardPass": "fp-b"}]})
    for name, spec, message in [
            ("twice", {"regimes": {"champions": [{"regime": KEY_A, "forwardPass": "x"},
                                                 {"regime": KEY_A, "forwardPass": "y"}]}}, "at most once"),
            ("both", {"forwardPass": "fp-a", "regimes": {"pin": KEY_A}}, "set one of them"),
            ("badname", {"regimes": {"pin": "regime-a"}}, "spec.regimes.pin")]:
        with pytest.raises(ApiException) as refused:
            create(name, **spec)
        assert refused.value.status == 422 and message in refused.value.body, refused.value.body
