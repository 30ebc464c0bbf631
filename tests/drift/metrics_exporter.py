"""A scrape target exporting the engine's metric series from real observations.

Run as a process: ``python metrics_exporter.py PORT MODEL``. It owns one
``shapeshift.engine.serving.metrics.EngineMetrics`` (the engine server's own metric
definitions, names and buckets) and serves it on ``GET /metrics``.
``POST /observe`` with ``{"prompt_tokens": n, "generation_tokens": m,
"cached_tokens": k}`` records one finished request the way the engine does
(``"count": c`` records ``c`` such requests at once):
the prompt and generation histograms observe ``n`` and ``m``, the generated-tokens
counter advances by ``m``, the prefix-cache counters advance by ``n`` queried and
``k`` hit tokens, and ``requests_total{status="stop"}`` counts it. ``POST /in-flight`` with
``{"running": r, "waiting": w}`` sets the two in-flight gauges until the next
such call, the way the engine publishes its scheduler's sets.

The drift tests use it only where they need an exact prefix-cache hit rate (a
fixed fraction of every prompt, or none at all), which the real engine's block
cache does not give, or an exact number of requests in flight over time; the
series, their labels and buckets are the engine server's own. Everything else (idle windows, a handful of requests, the cache
hits of a shared system prompt) runs against the real `shapeshift serve --model
tiny-llama` in test_prometheus_drift.py. Token counts come from the test, not
from a tokenizer.

Tests start it with ``exporter_process(model)`` (a context manager yielding its
``host:port``), record requests with ``observe(target, ...)`` and set the requests
in flight with ``in_flight(target, running, waiting)``.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

from shapeshift.engine.serving.metrics import EngineMetrics


def make_handler(metrics: EngineMetrics, lock: threading.Lock) -> type[BaseHTTPRequestHandler]:
    queried = {"tokens": 0, "hits": 0}
    flight = {"running": 0, "waiting": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep the test output quiet
            pass

        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            with lock:
                body, content_type = metrics.render()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            if self.path not in ("/observe", "/in-flight"):
                self.send_error(404)
                return
            data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/in-flight":
                with lock:
                    flight.update(running=int(data["running"]), waiting=int(data["waiting"]))
                    metrics.update_from_stats(_Stats(queried["tokens"], queried["hits"], **flight))
                self.send_response(204)
                self.end_headers()
                return
            prompt, generated = int(data["prompt_tokens"]), int(data["generation_tokens"])
            cached, count = int(data.get("cached_tokens", 0)), int(data.get("count", 1))
            if not 0 <= cached <= prompt:
                self.send_error(400, f"cached_tokens must be in [0, prompt_tokens], got {cached}")
                return
            if count < 1:
                self.send_error(400, f"count must be at least 1, got {count}")
                return
            with lock:
                for _ in range(count):
                    metrics.prompt_tokens.observe(prompt)
                    metrics.generation_tokens.observe(generated)
                    metrics.count_request("stop")
                metrics.generation_tokens_total.inc(generated * count)
                queried["tokens"] += prompt * count
                queried["hits"] += cached * count
                stats = _Stats(queried["tokens"], queried["hits"], **flight)
                metrics.update_from_stats(stats)
            self.send_response(204)
            self.end_headers()

    return Handler


class _Stats:
    """The fields of the engine's EngineStats that update_from_stats reads."""

    def __init__(self, queried: int, hits: int, running: int = 0, waiting: int = 0) -> None:
        self.num_running = running
        self.num_waiting = waiting
        self.batch_size_last_step = 1
        self.prefix_cache_queried_tokens = queried
        self.prefix_cache_hit_tokens = hits


@contextlib.contextmanager
def exporter_process(model: str) -> Iterator[str]:
    """This file run as its own process on a free loopback port; yields ``host:port``."""
    from harness.controlplane import _die_with_parent, free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, str(port), model], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    try:
        line = process.stdout.readline().decode()
        assert "serving" in line, f"exporter did not start: {line!r}"
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def observe(target: str, prompt_tokens: int, generation_tokens: int, cached_tokens: int, count: int = 1) -> None:
    """Record one finished request (``count`` alike ones) in the exporter at ``target``."""
    body = json.dumps({"prompt_tokens": prompt_tokens, "generation_tokens": generation_tokens,
                       "cached_tokens": cached_tokens, "count": count}).encode()
    request = urllib.request.Request(f"http://{target}/observe", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 204


def in_flight(target: str, running: int, waiting: int) -> None:
    """Set the exporter's requests in flight (running and waiting gauges) at ``target``."""
    body = json.dumps({"running": running, "waiting": waiting}).encode()
    request = urllib.request.Request(f"http://{target}/in-flight", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 204


def main() -> None:
    port, model = int(sys.argv[1]), sys.argv[2]
    metrics = EngineMetrics(model)
    metrics.set_forward_pass("stock", "0" * 64)
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(metrics, threading.Lock()))
    print(f"serving on 127.0.0.1:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
