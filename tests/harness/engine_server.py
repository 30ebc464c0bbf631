"""The real engine server for tests: `shapeshift serve` as a subprocess, and clients against it.

Data flow:

    ServerProcess(extra args) --Popen (cwd outside the repository, own session)-->
      `shapeshift serve --model tiny-llama ...` on a free loopback port
      --polled until /health answers 200--> base_url; its log goes to a file failures print
    scrape(base_url) --/metrics, Prometheus text parser--> {(sample name, sorted labels): value}
    Load(base_url) --client threads--> greedy /v1/completions back to back until stopped;
      every status and every failure (non-200 body or exception) recorded
    wait_for(predicate) --polls until true or a deadline--> seconds it took

Used by the server tests (tests/server/server_harness.py), the rollout tests
(tests/rollout/rollout_harness.py) and the hot-reload tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from harness.controlplane import free_port  # noqa: F401  (re-exported for the engine tests)

MODEL = "tiny-llama"
# Small settings keep the CPU work per test in milliseconds.
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 96
SERVER_START_TIMEOUT_S = 180.0
# Inherited admin-token variables would switch the admin API on behind a test's back.
_ADMIN_TOKEN_ENV_PREFIX = "SHAPESHIFT_ADMIN_TOKEN"


def shapeshift_command() -> list[str]:
    """The `shapeshift` console script of this interpreter's environment (or its module form)."""
    script = Path(sys.executable).parent / "shapeshift"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from shapeshift.engine.cli import main; sys.exit(main())"]


class ServerProcess:
    """`shapeshift serve` in a subprocess; `base_url` once `/health` answers 200.

    ``extra_args`` come last, so they may also override the flags set here.
    ``env`` is added to this process's environment (minus admin-token variables).
    ``max_model_len`` or ``num_kv_blocks`` None: the flag is left out (serve's own choice, as a pod).
    """

    def __init__(self, extra_args: list[str], log_path: Path, *, model: str = MODEL,
                 env: dict[str, str] | None = None, max_model_len: int | None = MAX_MODEL_LEN,
                 num_kv_blocks: int | None = NUM_KV_BLOCKS, log_level: str = "warning") -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.base_url = f"http://{self.address}"
        self.log_path = log_path
        self.env = env or {}
        sizes = [*(["--max-model-len", str(max_model_len)] if max_model_len is not None else []),
                 *(["--num-kv-blocks", str(num_kv_blocks)] if num_kv_blocks is not None else [])]
        self.args = shapeshift_command() + [
            "serve", "--model", model, "--host", "127.0.0.1", "--port", str(self.port), *sizes,
            "--device", "cpu", "--log-level", log_level, *extra_args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        env = {k: v for k, v in os.environ.items() if not k.startswith(_ADMIN_TOKEN_ENV_PREFIX)}
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


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample of a scrape, by name and labels besides `model`; fails if it is not exposed."""
    key = (name, tuple(sorted({"model": MODEL, **labels}.items())))
    assert key in samples, f"{name}{labels} not exposed; have {sorted({k[0] for k in samples})}"
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


# ------------------------------------------------------------------ load


def complete(base_url: str, prompt: str, max_tokens: int = 8, client: httpx.Client | None = None) -> httpx.Response:
    """One greedy /v1/completions request."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if client is not None:
        return client.post(base_url + "/v1/completions", json=body)
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


class Load:
    """Client threads sending greedy completions back to back until stopped.

    Records every status; a non-200 body or an exception (a dropped connection) also
    goes into ``errors``. ``settle_s``: seconds of load before the block's body runs
    and after it ends, so the body's action happens while requests are in flight. On exit
    each client completes at least one more request (so at least one per client is recorded).
    """

    def __init__(self, base_url: str, clients: int = 3, settle_s: float = 0.0) -> None:
        self.base_url, self.statuses, self.errors = base_url, [], []
        self.settle_s = settle_s
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                try:
                    r = complete(self.base_url, f"client {i} request {n} says", max_tokens=6, client=client)
                    self.statuses.append(r.status_code)
                    if r.status_code != 200:
                        self.errors.append(r.text[:300])
                except Exception as exc:  # anything a client sees counts as a failure, never ends the thread
                    self.errors.append(repr(exc))
                n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        time.sleep(self.settle_s)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(self.settle_s)
        # Every client finishes one more request first: the ones in flight while the body acted
        # (a swap from memory can be over before any request ends, leaving nothing to judge).
        wanted = len(self.statuses) + len(self.errors) + len(self.threads)
        deadline = time.monotonic() + 120
        while len(self.statuses) + len(self.errors) < wanted and time.monotonic() < deadline and exc[0] is None:
            time.sleep(0.05)
        self._stop.set()
        for t in self.threads:
            t.join(120)
