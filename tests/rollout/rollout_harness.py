"""Helpers for the rollout tests: `shapeshift serve` subprocesses with the rollout tests'
settings, annotation files written the way the kubelet writes them, a loopback HTTP artifact
server, and metric reads.

Every server is the real console command on a free loopback port, waited on through
`/health` (harness.engine_server.ServerProcess); its log goes to a file that failures print.
"""

from __future__ import annotations

import functools
import http.server
import os
import threading
from pathlib import Path

from harness import engine_server
from harness.engine_pods import forward_pass_info  # noqa: F401  (one definition, shared with the cluster tests)
from harness.engine_server import Load, complete, scrape, shapeshift_command, value, wait_for  # noqa: F401
from shapeshift.engine.contracts.pod_annotations import DesiredForwardPass, format_downward_api_map

CANDIDATES = Path(__file__).resolve().parents[1] / "fixtures" / "candidates"


class ServerProcess(engine_server.ServerProcess):
    """`shapeshift serve --model tiny-llama` with room for a few concurrent clients and info logs
    (rollout attempts are logged at info)."""

    def __init__(self, extra_args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(["--max-num-seqs", "8", *extra_args], log_path, env=env, num_kv_blocks=128,
                         log_level="info")


# ------------------------------------------------------------------ metrics


def reloads(base_url: str, result: str) -> float:
    return value(scrape(base_url), "shapeshift_forward_pass_reloads_total", result=result)


def gauge(base_url: str, name: str, **labels: str) -> float:
    return value(scrape(base_url), name, **labels)


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
