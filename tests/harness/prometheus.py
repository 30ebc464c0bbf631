"""A real Prometheus server on loopback for tests.

    scrape configs (from the test) -> <workdir>/prometheus.yml
      -> prometheus --web.listen-address=127.0.0.1:<free port>
                    --storage.tsdb.path=<workdir>/data      (thrown away with workdir)
      -> scrapes the test's targets -> HTTP API /api/v1/query -> query() / wait_for()
    restart(): stop, then the same port and data folder again (a Prometheus outage)

The binary is Debian's prometheus (2.42), found by harness.tools. Its defaults point at
/var/lib and 0.0.0.0:9090, so both are always overridden here. Ready takes well under a
second, but the first sample lands about 5 s later: Prometheus 2.x hands discovered
targets to its scrape loops on a fixed 5 s tick, which 2.42 has no flag for. Use
wait_for() rather than fixed sleeps.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

import yaml

from harness import tools
from harness.controlplane import free_port, spawn, wait_ready


class PrometheusError(RuntimeError):
    """Prometheus failed to start or a query failed; the message carries its answer or log."""


def static_job(job_name: str, *targets: str, metrics_path: str = "/metrics", interval: str = "1s") -> dict:
    """A scrape config for fixed `host:port` targets, scraped every `interval`."""
    return {
        "job_name": job_name,
        "metrics_path": metrics_path,
        "scrape_interval": interval,
        # Prometheus rejects a scrape_timeout longer than the interval.
        "scrape_timeout": interval,
        "static_configs": [{"targets": list(targets)}],
    }


class Prometheus:
    def __init__(
        self,
        workdir: Path,
        scrape_configs: list[dict],
        *,
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        rule_files: list[Path] | None = None,
    ):
        self.workdir = Path(workdir)
        self.config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
            "scrape_configs": scrape_configs,
        }
        if rule_files:
            self.config["rule_files"] = [str(path) for path in rule_files]
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        return self._launch(free_port(), timeout_s)

    def restart(self, timeout_s: float = 30.0) -> Prometheus:
        """Stop, then start again on the same port with the same data folder: the samples scraped
        before stay queryable (the TSDB replays its write-ahead log), and clients keep their URL."""
        self.stop()
        return self._launch(self.port, timeout_s)

    def _launch(self, port: int, timeout_s: float) -> Prometheus:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.port = port
        argv = [
            str(tools.prometheus()),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",  # lets a test POST /-/reload after editing the config
        ]
        self.process = spawn(argv, self.log_path, cwd=self.workdir)

        def ready() -> bool:
            # 503 while starting raises HTTPError, which wait_ready counts as not ready.
            with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:
                return response.status == 200

        try:
            wait_ready(ready, time.monotonic() + timeout_s, "prometheus /-/ready",
                       {"prometheus": (self.process, self.log_path)}, self.log_path, error=PrometheusError)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- HTTP API

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                body = json.load(response)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """Instant query; returns the result vector, e.g. [{"metric": {...}, "value": [t, "1"]}]."""
        data = self.api("query", query=promql)
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[float], bool] = lambda value: True,
        timeout_s: float = 30.0,
    ) -> float:
        """Poll `promql` until its first sample exists and satisfies `predicate`; return it."""
        deadline = time.monotonic() + timeout_s
        last: list[dict] = []
        while time.monotonic() < deadline:
            last = self.query(promql)
            if last:
                value = float(last[0]["value"][1])
                if predicate(value):
                    return value
            time.sleep(0.2)
        health = [(t["scrapeUrl"], t["health"], t.get("lastError")) for t in self.targets()]
        raise PrometheusError(f"{promql!r} never matched within {timeout_s}s; last result {last}; targets {health}")
