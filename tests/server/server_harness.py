"""Running `shapeshift serve` as a subprocess for the server tests.

Every server here is the real console command on a free loopback port, waited
on through `/health`; its log goes to a file that failures print.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-llama"
# Small settings keep the CPU work per test in milliseconds.
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 96
MAX_NUM_SEQS = 8
SERVER_START_TIMEOUT_S = 180.0


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
    """`shapeshift serve` in a subprocess; `base_url` once `/health` answers 200."""

    def __init__(self, extra_args: list[str], log_path: Path, model: str = MODEL) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.args = shapeshift_command() + [
            "serve", "--model", model, "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS),
            "--device", "cpu", "--log-level", "warning", *extra_args]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
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

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return "(no log)"

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


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model": MODEL, **labels}.items())))
    assert key in samples, f"{name}{labels} not exposed; have {sorted({k[0] for k in samples})}"
    return samples[key]
