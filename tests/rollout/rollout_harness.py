"""Helpers for the rollout tests: `shapeshift serve` subprocesses, annotation files written
the way the kubelet writes them, a loopback HTTP artifact server, and client load.

Every server is the real console command on a free loopback port, waited on through
`/health`; its log goes to a file that failures print.
"""

from __future__ import annotations

import functools
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from shapeshift.engine.rollout_protocol import DesiredForwardPass, format_downward_api_map

MODEL = "tiny-llama"
SERVER_START_TIMEOUT_S = 180.0
CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shapeshift_command() -> list[str]:
    script = Path(sys.executable).parent / "shapeshift"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from shapeshift.engine.cli import main; sys.exit(main())"]


class ServerProcess:
    """`shapeshift serve --model tiny-llama` in a subprocess; usable once `/health` answers 200."""

    def __init__(self, extra_args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = env or {}
        self.args = shapeshift_command() + [
            "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "8",
            "--device", "cpu", "--log-level", "info", *extra_args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        env = {k: v for k, v in os.environ.items() if not k.startswith("SHAPESHIFT_ADMIN_TOKEN")}
        env.update({"PYTHONSAFEPATH": "1", **self.env})
        self._log = open(self.log_path, "wb")
        # cwd outside the repository: the repo root's operator/ folder would shadow the stdlib.
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.log_path.parent, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shapeshift serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"shapeshift serve not healthy after {SERVER_START_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n_chars: int = 4000) -> str:
        return self.log_text()[-n_chars:] or "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if getattr(self, "_log", None) is not None:
            self._log.close()


# ------------------------------------------------------------------ metrics


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def forward_pass_info(base_url: str) -> dict[str, str]:
    """Labels (name, sha256) of the one shapeshift_forward_pass_info series."""
    infos = [dict(labels) for (name, labels) in scrape(base_url) if name == "shapeshift_forward_pass_info"]
    assert len(infos) == 1, infos
    return infos[0]


def reloads(base_url: str, result: str) -> float:
    key = ("shapeshift_forward_pass_reloads_total", tuple(sorted({"model": MODEL, "result": result}.items())))
    samples = scrape(base_url)
    assert key in samples, sorted({k[0] for k in samples})
    return samples[key]


def gauge(base_url: str, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model": MODEL, **labels}.items())))
    samples = scrape(base_url)
    assert key in samples, f"{name}{labels} not exposed"
    return samples[key]


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, on_timeout: Callable[[], str] = str,
             interval_s: float = 0.2) -> float:
    """Poll until ``predicate()``; returns the seconds it took, fails naming ``what``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if predicate():
            return time.monotonic() - t0
        time.sleep(interval_s)
    raise AssertionError(f"{what} not seen within {timeout_s:.0f} s\n{on_timeout()}")


# ------------------------------------------------------------------ annotations


def write_annotations(path: Path, annotations: dict[str, str]) -> None:
    """Replace the file atomically, as the kubelet swaps its ..data link (a reader never sees half)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(format_downward_api_map(annotations))
    os.replace(tmp, path)


def desire(path: Path, desired: DesiredForwardPass, other: dict[str, str] | None = None) -> None:
    """Annotations asking for ``desired``, next to unrelated ones a real pod carries."""
    write_annotations(path, {**(other or {"kubernetes.io/config.seen": "2025-01-01T00:00:00Z",
                                          "prometheus.io/scrape": "true"}), **desired.to_annotations()})


# ------------------------------------------------------------------ artifact server


class ArtifactServer:
    """`http.server` on loopback serving one folder (what a bundle store would be)."""

    def __init__(self, root: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "ArtifactServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    requests_seen: list[str] = []

    def log_message(self, fmt: str, *args) -> None:
        _QuietHandler.requests_seen.append(self.path)


# ------------------------------------------------------------------ load


class Load:
    """Client threads sending greedy completions back to back until stopped; records statuses."""

    def __init__(self, base_url: str, clients: int = 3) -> None:
        self.base_url, self.statuses, self.errors = base_url, [], []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(self.base_url + "/v1/completions",
                                    json={"model": MODEL, "prompt": f"client {i} request {n} says",
                                          "max_tokens": 6, "temperature": 0})
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(r.text[:300])
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(120)


def complete(base_url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                          "max_tokens": max_tokens, "temperature": 0}, timeout=120)
