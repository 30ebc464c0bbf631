"""The regime library on the real control plane, with a real Prometheus and the operator in-process.

An InferenceDeployment (policy OnDrift, drift and switches after two checks, no cooldowns) whose
status says its forward pass was compiled for very short prompts; its engine's series come from
tests/drift/metrics_exporter.py (the engine's EngineMetrics, real observations) scraped by Prometheus.

    traffic A (prompts ~100 tokens)  -> a CompileRun for regime A; its champion fp-a is published as
                                        a compile worker publishes it (the run vouches for it) and
                                        recorded in status.regimes, with what the compile spent
                                        (accelerators x the Job's wall time) and its payback
    traffic B (prompts ~600 tokens)  -> a CompileRun for regime B; fp-b written by hand (no run vouches
                                        for it) is not recorded; published by the run, it is
    traffic A again                  -> a switch to fp-a within two checks, no CompileRun, an event
                                        RegimeSwitched and the condition Regime saying why; the
                                        rollout's target is fp-a (status.rollout.desired)
    B for one check, then A          -> inside the hysteresis: no switch, no CompileRun

Each phase sends more requests than the Prometheus window still holds from the one before, so the
window's median is the new phase's.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import pytest

from drift.metrics_exporter import exporter_process, observe
from harness.cluster import wait_until

os.environ.setdefault("SHAPESHIFT_DRIFT_TIMER_SECONDS", "2")  # only effective if imported first

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
NAME = "llama"
KEY_A, KEY_B = "p0-h0-c0", "p1-h0-c0"


@pytest.fixture
def engine_metrics():
    with exporter_process("tiny-llama") as target:
        yield target


def send(target: str, count: int, low: int, high: int) -> None:
    """``count`` finished requests with prompts spread over [low, high) tokens, no prefix hits."""
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: observe(target, low + (i * 37) % (high - low), 16, 0), range(count)))


def test_traffic_back_in_a_known_regime_switches_to_its_champion_without_compiling(
        crds, namespace, engine_metrics, prometheus, monkeypatch):
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

    def publish(run: dict, champion: str, sha256: str, vouched: bool = True) -> None:
        """fp-X as a compile worker publishes it: the run's uid on the pass, the pass's name and spec
        digest in the run's status (phase Succeeded)."""
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
                         "metrics": {"speedup": 1.3},
                         "verification": {"passed": True, "gates": [{"name": "greedy-match", "passed": True}],
                                          "artifactSha256": sha256},
                         "compileRun": f"{namespace}/{run['metadata']['name']}"}}
        stored = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", body)
        time.sleep(2)  # an observation of the run already under way writes before the worker's status
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "compileruns", name, {
            "status": {"phase": "Succeeded", "champion": champion, "completionTime": now,
                       "championSpecSha256": ForwardPassSpec.model_validate(stored["spec"]).digest()}})
        time.sleep(3)
        assert stored_status()["phase"] == "Succeeded", stored_status()

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
        publish(run_a[0], "fp-a", "a" * 64)
        recorded = wait_until(lambda: regime(KEY_A).get("champion"), timeout_s=30 + 2 * tick,
                              what="fp-a recorded as regime A's champion")
        assert recorded["forwardPass"] == "fp-a" and recorded["sha256"] == "a" * 64
        assert recorded["speedup"] == 1.3 and recorded["accelerator"] == "cpu"
        assert recorded["compileRun"] == run_a[0]["metadata"]["name"]
        # economics by hand: the run's Job times (copied from the real Job), one accelerator; one serving
        # pod at x1.3 saves 1 - 1/1.3 accelerator-seconds per second
        stored = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns",
                                                     run_a[0]["metadata"]["name"])["status"]
        wall = (datetime.fromisoformat(stored["completionTime"].replace("Z", "+00:00"))
                - datetime.fromisoformat(stored["startTime"].replace("Z", "+00:00"))).total_seconds()
        assert recorded["compileAcceleratorSeconds"] == pytest.approx(wall)
        assert recorded["savedAcceleratorSecondsPerHour"] == pytest.approx(3600 * (1 - 1 / 1.3), rel=1e-4)
        assert recorded["paybackSeconds"] == pytest.approx(wall / (1 - 1 / 1.3), rel=1e-3, abs=1e-3)

        # B: compiled, its champion recorded
        send(engine_metrics, 100, 550, 700)
        run_b = wait_until(lambda: [r for r in runs() if r["metadata"]["name"] != run_a[0]["metadata"]["name"]],
                           timeout_s=60 + 4 * tick, what="the CompileRun of regime B")
        assert len(run_b) == 1 and run_b[0]["metadata"]["annotations"]["shapeshift.dev/regime"] == KEY_B
        assert 512 < run_b[0]["spec"]["traffic"]["inline"]["promptLength"]["p50"] <= 1024
        assert len(runs()) == 2  # no second run for A while its champion waited to be rolled out
        # first as anyone allowed to create ForwardPasses writes it: without the run's uid on it, the
        # run's word is not the pass's, and the library records nothing
        publish(run_b[0], "fp-b", "b" * 64, vouched=False)
        checked = (idep()["status"].get("drift") or {}).get("lastCheckTime")
        wait_until(lambda: (idep()["status"].get("drift") or {}).get("lastCheckTime") != checked,
                   timeout_s=20 + 2 * tick, what="a drift check after the hand-written fp-b")
        assert not regime(KEY_B).get("champion")
        # then as the run's worker publishes it
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", "fp-b")
        wait_until(lambda: not any(fp["metadata"]["name"] == "fp-b" for fp in custom.list_namespaced_custom_object(
            GROUP, VERSION, namespace, "forwardpasses")["items"]), timeout_s=20, what="fp-b deleted")
        publish(run_b[0], "fp-b", "b" * 64)
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
        time.sleep(12)  # one more check
        after = current()
        assert (after["name"], after["forwardPass"], after["lastSwitchTime"]) == (KEY_A, "fp-a", last_switch)
        assert len(runs()) == 2
    assert runner.exception is None, runner.output[-4000:]
    events = [e for e in crds.core.list_namespaced_event(namespace).items
              if e.involved_object.kind == "InferenceDeployment"]
    reasons = [e.reason for e in events]
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
