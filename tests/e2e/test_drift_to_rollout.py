"""Drift to rollout in one chain: traffic drifts, the operator compiles, verifies and rolls the winner out.

Data flow under test:
    test: InferenceDeployment (tiny-llama, CPU pool, 2 replicas, a prefill step of 16 tokens, policy
          OnDrift, artifact store, HotReload canary 1) -> the operator (in-process kopf, admin kubeconfig) -> engine Deployment
      -> kube-controller-manager, kube-scheduler, kwok -> 2 Running pods
      -> harness.kubelet (run_pod_locally, background) -> one real `shapeshift serve` per pod on its own
         loopback port, the artifact claim mapped to one shared folder
      -> Prometheus (static targets labelled pod/namespace/deployment) scrapes their /metrics
    short-prompt requests -> the drift timer observes them (no baseline yet: NoBaseline) -> the test
         records that observation as what the running pass was compiled for (status.compiledFor, as a
         finished rollout writes it) -> the next checks are Stable
    long-prompt requests -> the drift timer: Drifting, then Compile -> exactly one CompileRun, owned by
         the deployment, carrying the long-prompt snapshot and spec.compilation.template (agents, tiers,
         baseline) -> Job -> pod bound on the CPU pool
      -> harness.kubelet runs the pod's own `shapeshift compile --compile-run ns/run` with a token of the
         pod's ServiceAccount; ConfigMap/emptyDir volumes as folders, the artifact claim as the shared folder
      -> the worker replays the long prompts against the deployment's own settings (the pass to beat):
         the 16-token step that suited 12-24-token prompts takes each 140-200-token prefill in 9 to 13
         steps, so the traffic's first seed is the least token budget that fits the p90 prompt
         (engine/compile/agents/sweep.py traffic_guidance). The replay is open loop at the observed
         arrival rate (scaled to 0.9 of the deployed settings' capacity), where output tokens/s is
         bound by the arrivals for every candidate; what the wider step changes is the wait for a
         first token, which the template's SLO (TTFT_SLO_S) judges: a goodput of requests that
         meet it faster beyond the noise by the template's 1.05 and not slower per user (the p90
         veto), the seed is verified and published as a ForwardPass into the store
      -> the run Succeeds; the rollout timer takes its champion: canary pod annotated -> that engine
         hot-reloads (sha256 checked) -> Prometheus analysis under load -> promoted to every pod,
         each pod's /metrics reporting the new sha256.

A run that publishes no champion is checked up to its Succeeded status and the agreement of its status
with the (absent) ForwardPass objects, and the rollout part is skipped, saying so: of 6 runs here that
reached the compile, 5 kept the token-budget seed as champion and rolled it out, one lost it at the
screen and kept nothing. (Before
the traffic seeds it waited for a wider batch to win over a batch of 2, which on this CPU it rarely did.)
"""

from __future__ import annotations

import logging
import os
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest

from harness.cluster import wait_until
from harness.controlplane import POOL_LABEL
from harness.engine_pods import DeploymentLoad, forward_pass_info, serve_engine_pods
from harness.pod_environment import emulate_volumes, pod_token_kubeconfig
from shapeshift.engine.forward_pass.bundle import verify_bundle

# Fast timers, read when the operator modules are first imported (this test imports them).
os.environ.setdefault("SHAPESHIFT_RESYNC_SECONDS", "2")
os.environ.setdefault("SHAPESHIFT_DRIFT_TIMER_SECONDS", "2")

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
VENV_BIN = Path(sys.executable).parent
NAME, MODEL, CLAIM, SUB_PATH = "llama", "tiny-llama", "artifacts", "llama"
REPLICAS = 2
DEPLOYED_BATCH = 2
# Prefill tokens per scheduler step: enough for the short prompts, five to seven steps for each long one.
DEPLOYED_TOKEN_BUDGET = 16
TTFT_SLO_S = 0.04  # on the worker's clock (the measuring thread's CPU time)
CHECK_INTERVAL = 10  # the smallest check interval the CRD allows
SHORT_PROMPT, LONG_PROMPT, OUTPUT = (12, 24), (140, 200), 8
TRIALS = 16
# What every automatic CompileRun of the deployment runs with (spec.compilation.template): the coordinate
# sweep alone (after the traffic's seeds and the named recipes); tiers sized for this 2-core CPU (5 paired
# repeats: with 3, one noisy pair in the final comparison with the stock pass widened its 95% bounds below 1
# and withdrew a 1.16x champion), and a champion only when it is clearly faster than the stock pass.
TEMPLATE = {"agents": [{"kind": "coordinate-sweep"}], "tiers": {"replayRequests": 48, "repeats": 5},
            "baseline": {"minSpeedup": 1.05}, "slo": {"ttftP90Seconds": TTFT_SLO_S}}


# ---- reading the cluster and the engines -----------------------------------------------------


def get(cluster, namespace, plural, name) -> dict:
    return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)


def listed(cluster, namespace, plural) -> list[dict]:
    return cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)["items"]


def idep_status(cluster, namespace) -> dict:
    return get(cluster, namespace, "inferencedeployments", NAME).get("status") or {}


def conditions(status: dict) -> dict[str, dict]:
    return {c["type"]: c for c in status.get("conditions") or []}


def token_prompt(length: int, seed: int) -> list[int]:
    """A prompt of exactly `length` token ids (no tokenizer in between, so lengths are exact)."""
    return [5 + (seed * 31 + j * 7) % 200 for j in range(length)]


def send(urls: list[str], count: int, lengths: tuple[int, int], concurrency: int = 1,
         max_tokens: int = OUTPUT) -> None:
    """`count` completions of `max_tokens` spread over the engines, `concurrency` in flight at a time."""
    from concurrent.futures import ThreadPoolExecutor

    low, high = lengths

    def one(i: int) -> None:
        r = client.post(f"{urls[i % len(urls)]}/v1/completions", json={
            "model": MODEL, "prompt": token_prompt(low + (i * 13) % (high - low + 1), i),
            "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text

    # One pooled client: a connection per request would keep the threads busy in the client, not the engines.
    with httpx.Client(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client, \
            ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(count)))


def say(line: str) -> None:
    """Print past KopfRunner, which swaps sys.stdout for its own buffer while the operator runs."""
    print(line, file=sys.__stdout__, flush=True)


class DriftDecisions(logging.Handler):
    """The drift timer's decisions, in order, as the operator logs them ("drift check: <Decision> ...")."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.decisions: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("drift check: "):
            self.decisions.append(message.split("drift check: ", 1)[1].split()[0].rstrip(","))


# ---- the test --------------------------------------------------------------------------------


def test_long_prompts_compile_verify_and_roll_out_to_every_pod(crds, namespace, run_pod_locally, prometheus,
                                                               artifact_store, tmp_path, monkeypatch):
    from kopf.testing import KopfRunner

    cluster = crds
    started = time.monotonic()
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.setenv("SHAPESHIFT_ROLLOUT_MIN_REQUESTS", "5")
    import shapeshift.operator.handlers  # noqa: F401  (registers the handlers, the drift timer included)

    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": NAME},
        "spec": {
            "model": {"preset": MODEL}, "hardware": {"accelerator": "cpu"}, "replicas": REPLICAS,
            "engine": {"dtype": "float32", "maxModelLen": 256, "maxBatchSize": DEPLOYED_BATCH, "kvBlockSize": 16,
                       "maxNumBatchedTokens": DEPLOYED_TOKEN_BUDGET},
            "artifacts": {"pvc": {"claimName": CLAIM, "subPath": SUB_PATH}},
            "compilation": {"policy": "OnDrift", "cooldownSeconds": 3600,
                            "budget": {"trials": TRIALS, "wallClockSeconds": 150, "deadlineGraceSeconds": 120},
                            "template": TEMPLATE,
                            "drift": {"consecutiveChecks": 2, "checkIntervalSeconds": CHECK_INTERVAL,
                                      "windowSeconds": 60, "promptLengthRelativeChange": 0.3,
                                      "prefixHitRateAbsoluteChange": 0.5}},
            "rollout": {"strategy": "HotReload", "canaryReplicas": 1, "analysisWindowSeconds": 12,
                        "allowedRegression": 1.0, "loadTimeoutSeconds": 120},
        }})
    drift_log = DriftDecisions()
    operator_logger = logging.getLogger("kopf.objects")
    operator_logger.addHandler(drift_log)
    args = ["run", "--standalone", "--namespace", namespace, "-m", "shapeshift.operator.handlers"]
    with KopfRunner(args, timeout=60) as runner:
        # ---- engine pods as real servers, scraped by Prometheus -----------------------------
        urls = serve_engine_pods(cluster, namespace, NAME, REPLICAS, run_pod_locally=run_pod_locally,
                                 prometheus=prometheus, cache_dir=tmp_path / "engine-cache",
                                 pvc_dirs={CLAIM: artifact_store})
        stock = forward_pass_info(next(iter(urls.values())))["sha256"]

        # ---- short prompts: observed, adopted as the baseline, then stable -------------------
        send(list(urls.values()), 30, SHORT_PROMPT)
        short = wait_until(lambda: idep_status(cluster, namespace).get("observedTraffic"), 2 * CHECK_INTERVAL + 20,
                           "the short-prompt traffic observed")
        assert short["promptLength"]["p50"] <= 32, short
        assert conditions(idep_status(cluster, namespace))["Drifted"]["reason"] == "NoBaseline"
        # What the running pass is taken to be compiled for: the traffic it serves now.
        cluster.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "inferencedeployments",
                                                             NAME, {"status": {"compiledFor": short}})
        wait_until(lambda: conditions(idep_status(cluster, namespace))["Drifted"]["reason"] == "WithinThresholds",
                   2 * CHECK_INTERVAL + 10, "a Stable check against the short-prompt baseline")
        assert listed(cluster, namespace, "compileruns") == []

        # ---- long prompts: drift within two checks, one CompileRun ----------------------------
        # A burst of them, 16 in flight over the 2 pods, enough that the window's median is theirs.
        started_burst = time.monotonic()
        send(list(urls.values()), 240, LONG_PROMPT, concurrency=16)
        say(f"long-prompt burst took {time.monotonic() - started_burst:.1f}s")
        (run,) = wait_until(lambda: listed(cluster, namespace, "compileruns"), 3 * CHECK_INTERVAL + 20,
                            "a drift-triggered CompileRun")
        run_name = run["metadata"]["name"]
        assert run["metadata"]["ownerReferences"][0]["name"] == NAME
        assert run["spec"]["trigger"]["reason"] == "Drift"
        assert run["spec"]["budget"] == {"trials": TRIALS, "wallClockSeconds": 150, "deadlineGraceSeconds": 120}
        assert LONG_PROMPT[0] * 0.7 <= run["spec"]["traffic"]["inline"]["promptLength"]["p50"] <= 256, run["spec"]
        # The template's fields, as the API server stored them (inner defaults filled in), and nothing else of it.
        assert run["spec"]["agents"] == [{"kind": "coordinate-sweep", "replicas": 1}], run["spec"]
        assert {k: run["spec"]["tiers"][k] for k in TEMPLATE["tiers"]} == TEMPLATE["tiers"], run["spec"]["tiers"]
        assert run["spec"]["baseline"] == TEMPLATE["baseline"], run["spec"]
        # Compiled for prompts the deployed step takes in several goes.
        snapshot = run["spec"]["traffic"]["inline"]
        say(f"drift snapshot: concurrency {snapshot['concurrency']}, prompt p50 {snapshot['promptLength']['p50']}, "
            f"p90 {snapshot['promptLength']['p90']}")
        assert snapshot["promptLength"]["p90"] > DEPLOYED_TOKEN_BUDGET, snapshot
        # The run is created first, the deployment's status follows in the same check.
        st = wait_until(lambda: (lambda s: s if s.get("lastCompileRun") else None)(idep_status(cluster, namespace)),
                        10, "status.lastCompileRun")
        assert st["lastCompileRun"] == run_name
        assert conditions(st)["Drifted"]["reason"] in ("CompileRunCreated", "CompileInProgress")
        decisions = list(drift_log.decisions)
        after_stable = decisions[len(decisions) - decisions[::-1].index("Stable"):]
        assert after_stable[:2] == ["Drifting", "Compile"], decisions

        # ---- the Job's pod runs the real compile worker --------------------------------------
        def bound_pod():
            pods = cluster.core.list_namespaced_pod(
                namespace, label_selector=f"shapeshift.dev/compile-run={run_name}").items
            bound = [p for p in pods if p.spec.node_name]
            return cluster.api_client.sanitize_for_serialization(bound[0]) if bound else None

        pod = wait_until(bound_pod, 45, "the compile pod to be bound to a node")
        assert cluster.core.read_node(pod["spec"]["nodeName"]).metadata.labels[POOL_LABEL] == "cpu"
        (container,) = pod["spec"]["containers"]
        assert [*container["command"], *container["args"]] == ["shapeshift", "compile", "--compile-run",
                                                               f"{namespace}/{run_name}"]
        worker_env, _ = emulate_volumes(cluster, pod, tmp_path / "volumes")
        kubeconfig = pod_token_kubeconfig(cluster, pod, tmp_path / "pod-token-kubeconfig")
        worker_env.update(PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", KUBECONFIG=str(kubeconfig),
                          PYTHONSAFEPATH="1")
        compile_started = time.monotonic()
        local = run_pod_locally(namespace, pod["metadata"]["name"], timeout_s=240, extra_env=worker_env,
                                pvc_dirs={CLAIM: artifact_store})
        output = local.output()
        say(f"compile worker took {time.monotonic() - compile_started:.0f}s; its last lines:")
        say("\n".join(output.rstrip().splitlines()[-25:]))
        assert local.exit_codes == {"compile": 0}, output[-6000:]
        assert "Traceback" not in output, output[-6000:]

        run_st = wait_until(lambda: (lambda s: s if s.get("phase") in ("Succeeded", "Failed") else None)(
            get(cluster, namespace, "compileruns", run_name).get("status") or {}), 60, "the run to finish")
        assert run_st["phase"] == "Succeeded", run_st
        assert conditions(run_st)["Complete"]["status"] == "True"
        assert run_st["trials"]["total"] >= 1 and run_st["trials"]["failed"] == 0, run_st["trials"]
        say(f"run {run_name}: {run_st['message']}; leaderboard {run_st.get('leaderboard')}")
        fps = listed(cluster, namespace, "forwardpasses")
        assert len(listed(cluster, namespace, "compileruns")) == 1  # cooldown and in-progress: no second run
        if not run_st.get("champion"):
            # 1 run in 6 here: the seed's screen lost to a batch-width candidate that the closing
            # comparison withdrew (1.017x). The run's status must still agree with the cluster.
            assert fps == [] and "bestSpeedup" not in run_st, (fps, run_st)
            assert run_st["message"].startswith("no verified improvement"), run_st["message"]
            assert not list(artifact_store.rglob("*.tar.gz"))
            pytest.skip(f"the compile worker published no champion ({run_st['message']}); rollout not exercised")
        (fp,) = fps
        assert fp["metadata"]["name"] == run_st["champion"]
        spec = fp["spec"]
        digest = spec["artifact"]["sha256"]
        assert digest != stock
        assert spec["verification"]["passed"] is True and spec["compileRun"] == f"{namespace}/{run_name}"
        say(f"champion recipe's engine settings: { {k: v for k, v in spec['recipe'].items() if k.startswith('engine.')} }")
        # what the drift asked for: a step that takes more of a long prompt than the deployed 16 tokens
        assert spec["recipe"]["engine.max_num_batched_tokens"] > DEPLOYED_TOKEN_BUDGET, spec["recipe"]
        assert spec["metrics"]["speedup"] == pytest.approx(run_st["bestSpeedup"]) and run_st["bestSpeedup"] > 1.0
        archive = Path(urllib.parse.unquote(urllib.parse.urlparse(spec["artifact"]["uri"]).path))
        assert archive.is_relative_to(artifact_store.resolve()) and archive.is_file(), spec["artifact"]
        assert verify_bundle(archive).digest == digest
        assert fp["metadata"]["annotations"]["shapeshift.dev/artifact-durable"] == "true"

        # ---- rollout: canary first, then every pod --------------------------------------------
        with DeploymentLoad(list(urls.values()), model=MODEL, max_tokens=4,
                  prompt=lambda client, n: token_prompt(LONG_PROMPT[0], n)) as load:
            st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "Analyzing" else None)(
                idep_status(cluster, namespace)), 120, "the canary to report the champion (Analyzing)",
                interval_s=0.5)
            (canary,) = st["rollout"]["canaryPods"]
            running = {name: forward_pass_info(url)["sha256"] for name, url in urls.items()}
            assert running[canary] == digest
            assert all(sha == stock for name, sha in running.items() if name != canary), running
            st = wait_until(lambda: (lambda s: s if (s.get("rollout") or {}).get("phase") == "Complete" else None)(
                idep_status(cluster, namespace)), 120, "promotion to every pod (Complete)", interval_s=0.5)
        assert load.statuses.count(200) >= 5 and set(load.statuses) == {200}, sorted(set(load.statuses))
        for name, url in urls.items():
            assert forward_pass_info(url)["sha256"] == digest, name
        assert st["activeForwardPass"]["name"] == fp["metadata"]["name"] and st["activeForwardPass"]["sha256"] == digest
        assert all(p["sha256"] == digest for p in st["pods"]) and sorted(p["name"] for p in st["pods"]) == sorted(urls)
        assert conditions(st)["ForwardPassRolledOut"]["reason"] == "RolledOut"
        assert st["compiledFor"]["promptLength"]["p50"] >= LONG_PROMPT[0] * 0.7, st["compiledFor"]
    assert runner.exception is None, runner.output[-4000:]
    operator_logger.removeHandler(drift_log)
    assert drift_log.decisions.count("Compile") == 1, drift_log.decisions
    print(f"drift to rollout took {time.monotonic() - started:.0f}s")
