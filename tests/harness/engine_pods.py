"""Real engine servers behind an InferenceDeployment's pods, and clients that talk to them.

    engine Deployment --kube-controller-manager, kube-scheduler, kwok--> Running pods
      --serve_engine_pods: harness.kubelet (the run_pod_locally fixture, background)-->
        one real `shapeshift serve` per pod (the pod's own command line) on its own loopback port
      --a Prometheus (static targets labelled pod/namespace/deployment, scraped every second)-->
        named in the deployment's spec.prometheusUrl
      --> {pod name: base URL}
    forward_pass_info(base URL)  what the engine's /metrics says it runs (name, sha256, model)
    DeploymentLoad(base URLs)    clients spread over several engines, each sending greedy
                                 completions back to back with a prompt of the test's choosing,
                                 recording every status (-1: the request got no answer); for
                                 one engine and fixed text prompts see harness.engine_server.Load
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Callable

import httpx

from harness.cluster import wait_until
from harness.controlplane import free_port
from harness.engine_server import scrape

GROUP, VERSION = "shapeshift.dev", "v1alpha1"
VENV_BIN = Path(sys.executable).parent


def forward_pass_info(base_url: str) -> dict[str, str]:
    """The labels (model, name, sha256) of the engine's one shapeshift_forward_pass_info sample."""
    infos = [dict(labels) for (name, labels) in scrape(base_url) if name == "shapeshift_forward_pass_info"]
    assert len(infos) == 1, f"{base_url}: expected one shapeshift_forward_pass_info sample, got {infos}"
    return infos[0]


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def serve_engine_pods(cluster, namespace: str, deployment: str, replicas: int, *, run_pod_locally, prometheus,
                      cache_dir: Path, pvc_dirs: dict[str, Path] | None = None) -> dict[str, str]:
    """Wait for the deployment's `replicas` engine pods to run on kwok nodes, run each pod's real
    `shapeshift serve` locally, have a new Prometheus scrape them and point the deployment's
    spec.prometheusUrl at it. Returns {pod name: base URL} once every engine is healthy and scraped."""
    selector = f"shapeshift.dev/inference-deployment={deployment}"

    def running_pods():
        pods = cluster.core.list_namespaced_pod(namespace, label_selector=selector).items
        running = [p for p in pods if p.spec.node_name and p.status.phase == "Running"]
        return sorted(p.metadata.name for p in running) if len(running) == replicas else None

    names = wait_until(running_pods, 60, f"{replicas} engine pods Running")
    ports = {name: free_port() for name in names}
    server = prometheus([{
        "job_name": "engines", "scrape_interval": "1s", "scrape_timeout": "1s",
        "static_configs": [{"targets": [f"127.0.0.1:{port}"],
                            "labels": {"pod": name, "namespace": namespace, "deployment": deployment}}
                           for name, port in ports.items()],
    }])
    env = {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONSAFEPATH": "1",
           "SHAPESHIFT_CACHE": str(cache_dir)}
    for name, port in ports.items():
        run_pod_locally(namespace, name, background=True, extra_env=env, pvc_dirs=pvc_dirs, flag_overrides={
            "--host": "127.0.0.1", "--port": str(port), "--num-kv-blocks": "64"})
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    for url in urls.values():
        wait_until(lambda url=url: healthy(url), 120, f"engine at {url} healthy", interval_s=0.5)
    server.wait_for("count(shapeshift_forward_pass_info)", lambda v: v >= replicas, timeout_s=30)
    cluster.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, "inferencedeployments", deployment,
                                                  {"spec": {"prometheusUrl": server.url}})
    return urls


def _text_prompt(client: int, n: int) -> str:
    return f"client {client} request {n} says"


class DeploymentLoad:
    """`clients_per_url` clients per engine, each sending greedy completions back to back until
    the block ends. `statuses` holds every answer's HTTP status (-1: no answer), `errors` the body
    of every non-200 answer and every transport error."""

    def __init__(self, base_urls: list[str], *, model: str, max_tokens: int = 6, clients_per_url: int = 1,
                 prompt: Callable[[int, int], str | list[int]] = _text_prompt, timeout_s: float = 60.0):
        self.model, self.max_tokens, self.prompt, self.timeout_s = model, max_tokens, prompt, timeout_s
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=self.client, args=(url, i * clients_per_url + k), daemon=True)
                        for i, url in enumerate(base_urls) for k in range(clients_per_url)]

    def client(self, base_url: str, index: int) -> None:
        n = 0
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self.stop_event.is_set():
                try:
                    r = client.post(f"{base_url}/v1/completions", json={
                        "model": self.model, "prompt": self.prompt(index, n), "max_tokens": self.max_tokens,
                        "temperature": 0})
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(r.text[:300])
                except httpx.HTTPError as exc:
                    self.statuses.append(-1)
                    self.errors.append(repr(exc))
                n += 1

    def __enter__(self) -> "DeploymentLoad":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(self.timeout_s)
