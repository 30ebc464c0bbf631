#!/usr/bin/env python3
"""How many InferenceDeployments one operator keeps on their drift-check pace.

    tests/harness ControlPlane (etcd, kube-apiserver, controller-manager, scheduler, kwok; the
      default pools, the CPU pool widened to hold one pod per deployment) + the CRDs
    an exporter in this process: per deployment, one engine's metric series (the engine server's
      own EngineMetrics, restricted to the series the operator reads), fed one request per
      second of a fixed chat-like shape (no drift), served on /metrics/<deployment>
    a real Prometheus scraping one target per deployment (labels namespace, deployment, pod, as a
      ServiceMonitor adds them), its query log on
    N InferenceDeployments (cpu pool, 1 replica, policy Manual, drift checkIntervalSeconds =
      --interval, windowSeconds 60, spec.prometheusUrl = that Prometheus)
    `shapeshift operator` as its own process (the chart's settings: --resync-seconds 10, the drift
      timer's 10 s; SHAPESHIFT_HANDLER_WORKERS threads run its handlers), started once every
      deployment exists; the engine Deployments it creates get
      their pods Running on the kwok nodes
        --> warm-up (--warmup-intervals), then a measured window of --intervals drift intervals:
            each drift check of a deployment is the instant query
            sum(increase(shapeshift_prompt_tokens_count{namespace=..,deployment=..}[..])) in
            Prometheus's query log; the lag of a check is the time since that deployment's check
            before it, over its interval (a deployment still unchecked at the window's end counts
            with the time it has waited so far)
            and, from a watch on the InferenceDeployments, the same lag of the status writes (each new
            status.drift.lastCheckTime as received) and the time from observation to write
        --> bench/results/operator-scale-tiny-llama-cpu-<UTC stamp>.json: deployments, interval_s,
            max_check_lag_ratio, p99_check_lag_ratio, checks, the status writes' lag, operator_rss_mb (peak), the API
            server's requests/s (all clients; and those of the shapeshift.dev group), Prometheus
            queries/s (all; and the drift checks' share), commit, hardware, command

The interval is short (default 20 s, the drift timer's 10 s tick twice) so ten intervals fit in a
few minutes; the spec's minimum is 10 s. Run by hand, not by the test suite:

    python hack/bench_operator_scale.py --deployments 500 --interval 20 --intervals 10

tests/operator/test_bench_operator_scale.py checks the lag computation.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterable, Mapping

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the control-plane harness (tests/harness)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmeta

from shapeshift.operator.api import GROUP, VERSION  # noqa: E402
from shapeshift.operator.builders import LABEL_DEPLOYMENT  # noqa: E402

MODEL = "tiny-llama"
PODS_PER_NODE = 100  # the kwok nodes take 110
# The series the operator reads (drift: operator/prometheus.py observe; rollout: rollout_metrics.py)
EXPORTED = ("shapeshift_prompt_tokens", "shapeshift_generation_tokens", "shapeshift_prefix_cache_queries_tokens_total",
            "shapeshift_prefix_cache_hits_tokens_total", "shapeshift_requests_running", "shapeshift_requests_waiting",
            "shapeshift_forward_pass_info", "shapeshift_forward_pass_in_sync", "shapeshift_requests_total",
            "shapeshift_forward_pass_last_reload_status", "shapeshift_forward_pass_last_reload_timestamp_seconds")
DRIFT_QUERY = re.compile(r'^sum\(increase\(shapeshift_prompt_tokens_count\{[^}]*deployment="(?P<deployment>[^"]+)"')
# the drift scheduler's batched first query (operator/prometheus_batch.py): deployment=~"a|b|..."
DRIFT_BATCH_QUERY = re.compile(r'^sum by \([^)]*\) \(increase\(shapeshift_prompt_tokens_count\{[^}]*'
                               r'deployment=~"(?P<deployments>(?:[^"\\]|\\.)+)"')


def checked_deployments(query: str) -> list[str]:
    """The deployments a drift check's first query reads: one, or each of a batch."""
    match = DRIFT_QUERY.match(query)
    if match:
        return [match["deployment"]]
    match = DRIFT_BATCH_QUERY.match(query)
    if match:
        return [re.sub(r"\\(.)", r"\1", name) for name in match["deployments"].replace("\\\\", "\\").split("|")]
    return []


# ---- the lag of drift checks (pure; tests/operator/test_bench_operator_scale.py) ------------


class CheckLags:
    def __init__(self, ratios: list[float], checks: int, unchecked: list[str]):
        self.ratios = ratios  # one per measured gap, over the interval
        self.checks = checks  # checks inside the window
        self.unchecked = unchecked  # deployments with no check inside the window

    @property
    def max(self) -> float | None:
        return max(self.ratios) if self.ratios else None

    def quantile(self, q: float) -> float | None:
        """The nearest-rank quantile of the ratios."""
        return nearest_rank(sorted(self.ratios), q)


def nearest_rank(ordered: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile of ``ordered`` (sorted); None when empty."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else None


def check_lags(checks: Mapping[str, Iterable[float]], deployments: Iterable[str], interval_s: float,
               start: float, end: float) -> CheckLags:
    """The lags of the drift checks of ``deployments`` in the window [start, end] (seconds on one
    clock); ``checks``: deployment -> the times of its checks, before the window too.

    Each check inside the window counts with the time since the deployment's check before it (the
    first check of a deployment ever has none). At the window's end a deployment whose last check
    is more than an interval ago counts with the time it has waited so far, and one with no check
    in the window at all with at least the window: an operator that falls behind cannot hide it
    by never checking."""
    ratios: list[float] = []
    inside = 0
    unchecked = []
    for name in deployments:
        times = sorted(checks.get(name, ()))
        mine = [t for t in times if start <= t <= end]
        inside += len(mine)
        for before, after in zip(times, times[1:]):
            if start <= after <= end:
                ratios.append((after - before) / interval_s)
        last = max((t for t in times if t <= end), default=None)
        if not mine:
            unchecked.append(name)
            waited = end - last if last is not None else end - start
            ratios.append(max(waited, end - start) / interval_s)
        elif end - last > interval_s:
            ratios.append((end - last) / interval_s)
    return CheckLags(ratios, inside, unchecked)


def drift_checks(query_log: Path) -> dict[str, list[float]]:
    """deployment -> epoch seconds of its drift checks, from Prometheus's query log."""
    out: dict[str, list[float]] = {}
    for line in query_log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        for name in checked_deployments((entry.get("params") or {}).get("query") or ""):
            out.setdefault(name, []).append(_epoch(entry["ts"]))
    return out


def _epoch(stamp: str) -> float:
    """An RFC 3339 time from the query log (nanoseconds, Z or an offset) as epoch seconds."""
    stamp = re.sub(r"(\.\d{6})\d*", r"\1", stamp).replace("Z", "+00:00")
    return dt.datetime.fromisoformat(stamp).timestamp()


def query_log_counts(query_log: Path, start: float, end: float) -> tuple[int, int]:
    """(all queries, drift checks' first queries) logged in [start, end]."""
    total = drift = 0
    for line in query_log.read_text().splitlines():
        try:
            entry = json.loads(line)
            at = _epoch(entry["ts"])
        except (ValueError, KeyError):
            continue
        if start <= at <= end:
            total += 1
            drift += len(checked_deployments((entry.get("params") or {}).get("query") or ""))
    return total, drift


class StatusWrites:
    """Each deployment's drift status writes as a watch on the InferenceDeployments receives them:
    deployment -> [(received, status.drift.lastCheckTime)] (epoch seconds), one per new check time.
    The check time is the observation's (whole seconds); received minus it is how long the
    observation took to reach the status."""

    def __init__(self, custom, namespace: str, start: bool = True):
        self.custom, self.namespace = custom, namespace
        self.writes: dict[str, list[tuple[float, float]]] = {}
        self.stop = threading.Event()
        if start:
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from kubernetes import watch

        version = None
        while not self.stop.is_set():
            try:
                stream = watch.Watch().stream(self.custom.list_namespaced_custom_object, GROUP, VERSION,
                                              self.namespace, "inferencedeployments", timeout_seconds=30,
                                              **({"resource_version": version} if version else {}))
                for event in stream:
                    self.seen(event["object"], time.time())
                    version = event["object"]["metadata"].get("resourceVersion") or version
                    if self.stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a watch that expired (410) starts again from now
                version = None
                time.sleep(0.5)

    def seen(self, obj: dict, received: float) -> None:
        last = ((obj.get("status") or {}).get("drift") or {}).get("lastCheckTime")
        if not last:
            return
        mine = self.writes.setdefault(obj["metadata"]["name"], [])
        at = _epoch(last)
        if not mine or mine[-1][1] != at:
            mine.append((received, at))

    def received(self) -> dict[str, list[float]]:
        return {name: [r for r, _ in writes] for name, writes in self.writes.items()}

    def delays(self, start: float, end: float) -> list[float]:
        return sorted(r - at for writes in self.writes.values() for r, at in writes if start <= r <= end)


# ---- the scrape targets ------------------------------------------------------------------------


class Exporter:
    """One engine's metric series per deployment on /metrics/<deployment>, fed one request a second
    on average: every `period` seconds each deployment records `period` requests and its page is
    rendered once, so a scrape costs a dictionary look-up (500 scrape targets on two shared cores)."""

    def __init__(self, deployments: list[str], seed: int = 0, period: float = 5.0):
        from shapeshift.engine.serving.metrics import EngineMetrics

        self.period = period
        self.pages: dict[str, bytes] = {}
        self.metrics = {}
        for name in deployments:
            m = EngineMetrics(MODEL)
            m.set_forward_pass("stock", "0" * 64)
            self.metrics[name] = (m, m.registry.restricted_registry(
                {n + suffix for n in EXPORTED for suffix in ("", "_bucket", "_count", "_sum")}))
        self.rng = random.Random(seed)
        self.queried = dict.fromkeys(deployments, 0)
        self.stop = threading.Event()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                body = exporter.pages.get(self.path.rpartition("/")[2])
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:  # a scrape that timed out meanwhile
                    pass

        self._record(0)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.threads = [threading.Thread(target=self.server.serve_forever, daemon=True),
                        threading.Thread(target=self._traffic, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _traffic(self) -> None:
        requests = max(1, round(self.period))
        while not self.stop.wait(self.period):
            self._record(requests)

    def _record(self, requests: int) -> None:
        """`requests` finished requests of a stable chat-like shape per deployment (prompts of 100-300
        tokens, 20-60 generated, a third of the prompt cached), then every page rendered."""
        from prometheus_client import generate_latest

        class Stats:
            num_running, num_waiting, batch_size_last_step = 2, 0, 2

        for name, (m, restricted) in self.metrics.items():
            for _ in range(requests):
                prompt = self.rng.randint(100, 300)
                m.prompt_tokens.observe(prompt)
                m.generation_tokens.observe(self.rng.randint(20, 60))
                m.count_request("stop")
                self.queried[name] += prompt
            stats = Stats()
            stats.prefix_cache_queried_tokens = self.queried[name]
            stats.prefix_cache_hit_tokens = self.queried[name] // 3
            m.update_from_stats(stats)
            self.pages[name] = generate_latest(restricted)

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def scrape_config(exporter: Exporter, namespace: str, deployments: list[str], interval: str) -> dict:
    """One target per deployment, labelled as a ServiceMonitor labels an engine pod's target."""
    return {"job_name": "engines", "scrape_interval": interval, "scrape_timeout": interval,
            "static_configs": [{"targets": [exporter.address],
                                "labels": {"__metrics_path__": f"/metrics/{name}", "instance": f"{name}-engine",
                                           "namespace": namespace, "deployment": name, "pod": f"{name}-engine"}}
                               for name in deployments]}


# ---- measurements ------------------------------------------------------------------------------


def apiserver_requests(cluster) -> tuple[float, float, dict[str, float]]:
    """(all requests, Shapeshift's API group's, by "verb resource[/subresource]") the API server has
    counted (apiserver_request_total)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    total = ours = 0.0
    by: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("apiserver_request_total{"):
            value = float(line.rsplit(" ", 1)[1])
            total += value
            ours += value if f'group="{GROUP}"' in line else 0.0
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            key = f"{labels.get('verb', '')} {labels.get('resource', '')}" + (
                f"/{labels['subresource']}" if labels.get("subresource") else "")
            by[key] = by.get(key, 0.0) + value
    return total, ours, by


def busiest(before: dict[str, float], after: dict[str, float], span: float, top: int = 8) -> dict[str, float]:
    """The ``top`` request kinds by rate over ``span`` seconds."""
    rates = {key: (after[key] - before.get(key, 0.0)) / span for key in after}
    return {key: round(rate, 1) for key, rate in sorted(rates.items(), key=lambda kv: -kv[1])[:top] if rate > 0}


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (threads included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def traffic_observed(cluster, namespace: str) -> dict[str, int]:
    """How many deployments' TrafficObserved condition is True, False, or absent."""
    items = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments")["items"]
    out: dict[str, int] = {}
    for item in items:
        cond = next((c for c in (item.get("status") or {}).get("conditions") or [] if c["type"] == "TrafficObserved"),
                    None)
        key = cond["status"] if cond else "absent"
        out[key] = out.get(key, 0) + 1
    return out


def deployment_body(name: str, prometheus_url: str, interval_s: int) -> dict:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": {"model": {"preset": MODEL}, "hardware": {"accelerator": "cpu"}, "replicas": 1,
                     "prometheusUrl": prometheus_url,
                     "compilation": {"policy": "Manual",
                                     "drift": {"checkIntervalSeconds": interval_s, "windowSeconds": 60}}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deployments", type=int, default=500)
    parser.add_argument("--interval", type=int, default=20, help="drift checkIntervalSeconds (>= 10)")
    parser.add_argument("--intervals", type=int, default=10, help="drift intervals measured")
    parser.add_argument("--warmup-intervals", type=float, default=2.0,
                        help="drift intervals after every engine pod runs, before the measured window")
    parser.add_argument("--resync-seconds", type=float, default=10.0, help="the operator's (the chart's default)")
    parser.add_argument("--scrape-interval", type=int, default=10, help="seconds")
    parser.add_argument("--handler-workers", type=int, default=None,
                        help="the operator's SHAPESHIFT_HANDLER_WORKERS (default: operator/settings.py's)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the control plane's files here")
    args = parser.parse_args(argv)
    if args.interval < 10:
        parser.error("--interval: spec.compilation.drift.checkIntervalSeconds is at least 10")

    from benchmeta import claim_result_name, git_commit, result_name
    from harness.cluster import Cluster, wait_until
    from harness.controlplane import DEFAULT_POOLS, ControlPlane
    from harness.operator_process import VENV_BIN, operator_healthy, stop_operator
    from harness.controlplane import free_port
    from harness.prometheus import Prometheus
    from shapeshift.operator.settings import OperatorSettings

    started = dt.datetime.now(dt.timezone.utc)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-operator-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    names = [f"d{index:04d}" for index in range(args.deployments)]
    nodes = max(2, math.ceil(args.deployments / PODS_PER_NODE))
    pools = tuple(p if p.name != "cpu" else type(p)(p.name, nodes, p.instance_type, p.capacity, p.labels, p.taints)
                  for p in DEFAULT_POOLS)
    namespace = "scale"
    timings: dict[str, float] = {}
    plane = ControlPlane(workdir / "controlplane", pools).start(timeout_s=120)
    exporter = prometheus = operator = None
    try:
        cluster = Cluster(plane.kubeconfig, control_plane=plane)
        for path in sorted((REPO / "crds").glob("shapeshift.dev_*.yaml")):
            cluster.apply(path)
        cluster.create_namespace(namespace)

        exporter = Exporter(names, period=args.scrape_interval / 2)
        prometheus = Prometheus(workdir / "prometheus", [scrape_config(exporter, namespace, names,
                                                                       f"{args.scrape_interval}s")])
        query_log = workdir / "prometheus" / "queries.jsonl"
        prometheus.config["global"]["query_log_file"] = str(query_log)
        prometheus.start()
        wait_until(lambda: len(prometheus.query("up == 1")) == len(names), 120, "every target scraped", 2)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda n: cluster.custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, "inferencedeployments", deployment_body(n, prometheus.url, args.interval)),
                names))
        timings["create_deployments_s"] = round(time.monotonic() - t0, 1)

        port = free_port()
        env = {**os.environ, "KUBECONFIG": str(plane.kubeconfig), "PYTHONSAFEPATH": "1",
               "SHAPESHIFT_DRIFT_TIMER_SECONDS": "10"}
        if args.handler_workers is not None:
            env["SHAPESHIFT_HANDLER_WORKERS"] = str(args.handler_workers)
        cmd = [str(VENV_BIN / "shapeshift"), "operator", "--namespace", namespace, "--standalone", "--quiet",
               "--resync-seconds", str(args.resync_seconds), "--liveness", f"http://127.0.0.1:{port}/healthz"]
        log = open(workdir / "operator.log", "ab")
        t0 = time.monotonic()
        operator = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: operator_healthy(port), 120, "the operator's liveness endpoint", 1)

        def running_pods() -> int:
            pods = cluster.core.list_namespaced_pod(namespace, label_selector=LABEL_DEPLOYMENT)
            return sum(p.status.phase == "Running" for p in pods.items)

        wait_until(lambda: running_pods() >= len(names), 900, f"{len(names)} engine pods Running", 5)
        timings["operator_to_all_pods_running_s"] = round(time.monotonic() - t0, 1)

        writes = StatusWrites(cluster.custom, namespace)
        time.sleep(args.warmup_intervals * args.interval)
        window_s = args.intervals * args.interval
        start = time.time()
        api_before = apiserver_requests(cluster)
        cpu_before = cpu_seconds(operator.pid)
        rss: list[float] = []
        while time.time() < start + window_s:
            value = rss_mb(operator.pid)
            if value is not None:
                rss.append(value)
            time.sleep(2)
        end = time.time()
        api_after = apiserver_requests(cluster)
        cpu_after = cpu_seconds(operator.pid)
        alive = operator.poll() is None
        observed = traffic_observed(cluster, namespace)
        load = [round(x, 2) for x in os.getloadavg()]  # 1, 5, 15 min at the window's end
        time.sleep(2)  # the query log is written as queries finish
        lags = check_lags(drift_checks(query_log), names, args.interval, start, end)
        writes.stop.set()
        write_lags = check_lags(writes.received(), names, args.interval, start, end)
        delays = writes.delays(start, end)
        queries, drift_queries = query_log_counts(query_log, start, end)
        span = end - start
    finally:
        if operator is not None:
            stop_operator(operator)
        if prometheus is not None:
            prometheus.stop()
        if exporter is not None:
            exporter.close()
        plane.stop()

    commit, dirty = git_commit()
    result = {
        "benchmark": "operator-scale",
        "commit": commit, "dirty": dirty,
        "hardware": "cpu",
        "host": {"cpus": os.cpu_count(), "note": "the control plane, Prometheus, the exporter and the operator share "
                                                  "these cores (and other users' processes)"},
        "command": " ".join(["python3", "hack/bench_operator_scale.py"] + (argv if argv is not None else sys.argv[1:])),
        "started": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "deployments": len(names),
        "interval_s": args.interval,
        "drift_timer_s": 10,
        "resync_s": args.resync_seconds,
        "scrape_interval_s": args.scrape_interval,
        "handler_workers": (args.handler_workers if args.handler_workers is not None
                            else OperatorSettings.from_environ({}).handler_workers),
        "window_s": round(span, 1),
        "intervals_measured": round(span / args.interval, 2),
        "checks": lags.checks,
        "checks_expected": round(len(names) * span / args.interval),
        "unchecked_deployments": len(lags.unchecked),
        "max_check_lag_ratio": _round(lags.max),
        "p99_check_lag_ratio": _round(lags.quantile(0.99)),
        "p50_check_lag_ratio": _round(lags.quantile(0.5)),
        "within_1_5x": None if lags.max is None else lags.max <= 1.5,
        # the same lag of the status writes (a new status.drift.lastCheckTime, as a watch receives it)
        "status_writes": write_lags.checks,
        "max_status_write_lag_ratio": _round(write_lags.max),
        "p99_status_write_lag_ratio": _round(write_lags.quantile(0.99)),
        "p50_status_write_lag_ratio": _round(write_lags.quantile(0.5)),
        # seconds from a check's observation (lastCheckTime, whole seconds) to its status write
        "observe_to_write_s": {"p50": _round(nearest_rank(delays, 0.5), 1),
                               "p99": _round(nearest_rank(delays, 0.99), 1),
                               "max": _round(delays[-1] if delays else None, 1)},
        "operator_rss_mb": _round(max(rss) if rss else None, 1),
        "operator_rss_mb_end": _round(rss[-1] if rss else None, 1),
        "load_average": load,
        "operator_alive": alive,
        "operator_cpu_cores": (None if cpu_before is None or cpu_after is None
                               else round((cpu_after - cpu_before) / span, 2)),
        "traffic_observed_conditions": observed,
        "api_requests_per_s": _round((api_after[0] - api_before[0]) / span, 1),
        "api_requests_per_s_shapeshift_group": _round((api_after[1] - api_before[1]) / span, 1),
        "api_requests_per_s_busiest": busiest(api_before[2], api_after[2], span),
        "prometheus_queries_per_s": _round(queries / span, 1),
        "prometheus_drift_checks_per_s": _round(drift_queries / span, 2),
        "setup": timings,
    }
    name = claim_result_name(args.out, result_name("operator-scale", MODEL, "cpu", started))
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {args.out / (name + '.json')}")
    return 0


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


if __name__ == "__main__":
    sys.exit(main())
