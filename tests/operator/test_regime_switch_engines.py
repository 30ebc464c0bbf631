"""Regime switches served by real engine pods: A's champion, traffic moves to B (whose champion the
library holds already) and back to A, with no CompileRun.

    InferenceDeployment (tiny-llama, cpu pool, 2 replicas, policy OnDrift: drift alone would compile;
      switches after 2 checks, no cooldown) --operator (in-process kopf: handlers and the drift timer)-->
      engine Deployment --kube-controller-manager, kube-scheduler, kwok--> 2 Running pods
      --harness.kubelet--> one real `shapeshift serve` per pod, scraped by a real Prometheus
    fp-a, fp-b: real bundles (the stock pass with fuse_qkv, with fuse_gate_up), each published as a
      compile worker publishes it, vouched for by its CompileRun (the run's uid on the pass, the pass's
      name and spec digest in the run's Succeeded status; the run's deployment does not exist, so no
      Job); status.regimes names each run as its regime's compileRun, so the drift timer records
      both champions (RegimeChampionRecorded), and status.currentRegime says the library switched to
      fp-a in A an hour ago: the rollout's target is fp-a
    traffic A (100-token prompts)  -> every pod reports fp-a's sha256
    traffic B (400-token prompts)  -> the second check that observes B switches to fp-b (the checks
                                      counted in status.regimes), no CompileRun -> every pod fp-b's
    traffic A again                -> the second check that observes A switches to fp-a, no CompileRun
                                      -> every pod fp-a's sha256 again

The traffic never stops: one client per pod (concurrency bucket c0), random prompts (no prefix
hits), 8 output tokens (o0). Each move starts with back-to-back requests, so that the Prometheus
window's median prompt is the new shape's within seconds, then paces them (0.4 s apart), so that
the next move outnumbers what the window still holds.
"""

from __future__ import annotations

import os
import random
import threading
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest

from harness.cluster import wait_until
from harness.engine_pods import forward_pass_info, serve_engine_pods

os.environ.setdefault("SHAPESHIFT_DRIFT_TIMER_SECONDS", "2")  # only effective if imported first
os.environ.setdefault("SHAPESHIFT_RESYNC_SECONDS", "2")

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
NAME, MODEL = "llama", "tiny-llama"
KEY_A, KEY_B = "p0-h0-c0-o0", "p1-h0-c0-o0"
PROMPT_A, PROMPT_B, OUTPUT = 100, 400, 8
PACED = 0.4  # seconds between a client's requests once a move took hold


class ShapedLoad:
    """One client per engine sending greedy completions of random ``length``-token prompts, ``pause``
    seconds apart; both can change while it runs. ``statuses``: every answer's status (-1: none)."""

    def __init__(self, urls: list[str], length: int, pause: float = 0.0):
        self.length, self.pause = length, pause
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(url, i), daemon=True) for i, url in enumerate(urls)]

    def client(self, url: str, index: int) -> None:
        rng = random.Random(index)
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                prompt = [rng.randrange(0, 256) for _ in range(self.length)]
                try:
                    r = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                                    "max_tokens": OUTPUT, "temperature": 0})
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(r.text[:300])
                except httpx.HTTPError as exc:
                    self.statuses.append(-1)
                    self.errors.append(repr(exc))
                if self.pause:
                    self.stop.wait(self.pause)

    def __enter__(self) -> "ShapedLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def profile(prompt: int) -> dict:
    from shapeshift.engine.contracts.traffic_profile import LengthDistribution, TrafficProfile

    return TrafficProfile(name=f"prompts-{prompt}", prompt_length=LengthDistribution(p50=prompt, p90=prompt, p99=prompt),
                          output_length=LengthDistribution(p50=OUTPUT, p90=OUTPUT, p99=OUTPUT),
                          prefix_cache_hit_rate=0.0, concurrency=1).to_dict()


def test_real_engines_switch_between_known_champions_without_compiling(
        crds, namespace, run_pod_locally, prometheus, monkeypatch, tmp_path):
    from kopf.testing import KopfRunner

    from shapeshift.engine.forward_pass.bundle import create_bundle, load_manifest, stock_bundle_dir
    from shapeshift.operator.api import COMPILE_RUN_UID_ANNOTATION, ForwardPassSpec

    custom = crds.custom
    now = datetime.now(timezone.utc).replace(microsecond=0)
    stamp = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731

    def publish(name: str, recipe: dict, regime_prompt: int) -> str:
        """fp-<x> as its CompileRun's worker publishes it; returns its sha256."""
        archive = tmp_path / "bundles" / f"{name}.tar.gz"
        create_bundle(stock_bundle_dir(), recipe, archive, name=name)
        digest = load_manifest(archive).digest
        run = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "CompileRun", "metadata": {"name": f"{name}-run"},
            "spec": {"deploymentRef": {"name": "compiled-elsewhere"}}})
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ForwardPass",
                "metadata": {"name": name, "annotations": {COMPILE_RUN_UID_ANNOTATION: run["metadata"]["uid"]}},
                "spec": {"model": {"name": MODEL, "dtype": "float32"}, "hardware": {"accelerator": "cpu"},
                         "traffic": profile(regime_prompt), "artifact": {"uri": str(archive), "sha256": digest},
                         "recipe": recipe, "metrics": {"speedup": 1.2, "baselineTokensPerSecond": 100.0},
                         "verification": {"passed": True, "gates": [{"name": "greedy-match", "passed": True}],
                                          "artifactSha256": digest},
                         "compileRun": f"{namespace}/{name}-run"}}
        stored = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "forwardpasses", body)
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "compileruns", f"{name}-run", {
            "status": {"phase": "Succeeded", "champion": name, "startTime": stamp(now - timedelta(hours=2)),
                       "completionTime": stamp(now - timedelta(hours=1, minutes=30)),
                       "championSpecSha256": ForwardPassSpec.model_validate(stored["spec"]).digest()}})
        return digest

    digest_a = publish("fp-a", {"fuse_qkv": True}, PROMPT_A)
    digest_b = publish("fp-b", {"fuse_gate_up": True}, PROMPT_B)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {
            "model": {"preset": MODEL}, "hardware": {"accelerator": "cpu"}, "replicas": 2,
            "engine": {"dtype": "float32", "maxModelLen": 512, "maxBatchSize": 8},
            "compilation": {"policy": "OnDrift", "cooldownSeconds": 0,
                            "drift": {"consecutiveChecks": 2, "checkIntervalSeconds": 10, "windowSeconds": 60}},
            "regimes": {"switchChecks": 2, "switchCooldownSeconds": 0},
            "rollout": {"canaryReplicas": 1, "analysisWindowSeconds": 10, "allowedRegression": 1.0,
                        "loadTimeoutSeconds": 120},
        },
    })
    seen = {"firstSeen": stamp(now - timedelta(hours=3)), "lastSeen": stamp(now - timedelta(hours=1)),
            "checks": 10, "visits": 1, "dwellSeconds": 600, "prefixCacheHitRate": 0.0, "concurrency": 1,
            "outputLengthP50": OUTPUT}
    custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "inferencedeployments", NAME, {"status": {
        "compiledFor": profile(PROMPT_A),
        "regimes": [{"name": KEY_A, "promptLengthP50": PROMPT_A, "compileRun": "fp-a-run", **seen},
                    {"name": KEY_B, "promptLengthP50": PROMPT_B, "compileRun": "fp-b-run", **seen}],
        "currentRegime": {"name": KEY_A, "since": stamp(now - timedelta(hours=1)), "forwardPass": "fp-a",
                          "sha256": digest_a, "lastSwitchTime": stamp(now - timedelta(hours=1)),
                          "observed": KEY_A, "observedChecks": 1, "observedSince": stamp(now - timedelta(hours=1))}}})

    def status() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments",
                                                   NAME).get("status") or {}

    def checks(st: dict, key: str) -> int:
        return next((r["checks"] for r in st.get("regimes") or [] if r["name"] == key), 0)

    def deployment_runs() -> list[dict]:
        return [r for r in custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "compileruns")["items"]
                if r["spec"]["deploymentRef"]["name"] == NAME]

    monkeypatch.setenv("KUBECONFIG", str(crds.kubeconfig))
    monkeypatch.setenv("SHAPESHIFT_ROLLOUT_MIN_REQUESTS", "5")
    # Both champions run at the stock pass's speed, and this test is about the library, not the
    # canary analysis (tests/operator/test_cluster_rollout.py judges a slow candidate): at the
    # default 2 ms resolution, a busy machine once made a canary's p90 of a few milliseconds look
    # 2.7x slower (1.9 -> 5.2 ms) and the rollout of fp-a was rolled back.
    monkeypatch.setenv("SHAPESHIFT_ROLLOUT_LATENCY_RESOLUTION_SECONDS", "0.05")
    import shapeshift.operator.handlers  # noqa: F401
    from shapeshift.operator.handlers import drift as drift_handlers  # noqa: F401  (registers the timer)

    args = ["run", "--standalone", "--namespace", namespace,
            "-m", "shapeshift.operator.handlers", "-m", "shapeshift.operator.handlers.drift"]
    with KopfRunner(args, timeout=120) as runner:
        urls = serve_engine_pods(crds, namespace, NAME, 2, run_pod_locally=run_pod_locally, prometheus=prometheus,
                                 cache_dir=tmp_path / "engine-cache")

        def served(name: str, digest: str, what: str) -> dict:
            """Every pod reports ``digest`` and the rollout is Complete on ``name``."""
            def done():
                st = status()
                ok = ((st.get("rollout") or {}).get("phase") == "Complete"
                      and (st.get("activeForwardPass") or {}).get("sha256") == digest)
                return st if ok and all(forward_pass_info(u)["sha256"] == digest for u in urls.values()) else None
            st = wait_until(done, 150, what, interval_s=0.5)
            assert {n: forward_pass_info(u) for n, u in urls.items()} == {
                n: {"model": MODEL, "name": name, "sha256": digest} for n in urls}
            return st

        def move(key: str, length: int, champion: str, digest: str) -> None:
            """Traffic to ``key``: the switch to ``champion`` on the second check observing it."""
            before = checks(status(), key)
            load.length, load.pause = length, 0.0
            first = wait_until(lambda: (lambda st: st if (st.get("currentRegime") or {}).get("observed") == key
                                        else None)(status()), 60, f"a check observing {key}", interval_s=0.5)
            load.pause = PACED
            assert first["currentRegime"]["observedChecks"] == 1 and checks(first, key) == before + 1, first
            assert first["currentRegime"].get("forwardPass") != champion
            switched = wait_until(lambda: (lambda st: st if (st.get("currentRegime") or {}).get("forwardPass")
                                           == champion else None)(status()), 40, f"the switch to {champion}",
                                  interval_s=0.5)
            current = switched["currentRegime"]
            # counted: the check that switched is the second one observing the regime, the one after the first
            assert (current["name"], current["observed"], current["observedChecks"]) == (key, key, 2), current
            assert checks(switched, key) == before + 2, switched["regimes"]
            assert current["sha256"] == digest and "no CompileRun" in current["reason"], current
            condition = {c["type"]: c for c in switched["conditions"]}["Regime"]
            assert (condition["status"], condition["reason"]) == ("True", "SwitchedToChampion"), condition
            assert not deployment_runs()

        with ShapedLoad(list(urls.values()), PROMPT_A, PACED) as load:
            # A: the library's champion fp-a on every pod; both champions recorded from their CompileRuns
            st = served("fp-a", digest_a, "fp-a on every pod")
            recorded = {r["name"]: (r.get("champion") or {}).get("forwardPass") for r in st["regimes"]}
            assert recorded == {KEY_A: "fp-a", KEY_B: "fp-b"}, st["regimes"]
            move(KEY_B, PROMPT_B, "fp-b", digest_b)
            served("fp-b", digest_b, "fp-b on every pod")
            move(KEY_A, PROMPT_A, "fp-a", digest_a)
            served("fp-a", digest_a, "fp-a on every pod again")
        assert load.statuses.count(200) >= 50 and set(load.statuses) == {200}, load.errors[:5]
        assert not deployment_runs()
    assert runner.exception is None, runner.output[-4000:]
    reasons = [e.reason for e in crds.core.list_namespaced_event(namespace).items
               if e.involved_object.kind == "InferenceDeployment"]
    assert reasons.count("RegimeSwitched") == 2 and "CompileRunCreated" not in reasons, reasons
    assert reasons.count("RegimeChampionRecorded") == 2, reasons
