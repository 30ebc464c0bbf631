"""`shapeshift operator` as its own process, the way the chart's Deployment runs it.

    start_operator(cluster, namespace, log, port, kubeconfig=None, env=None)
        --> `shapeshift operator --namespace NS --standalone --resync-seconds 2
             --liveness http://127.0.0.1:PORT/healthz` (the admin kubeconfig unless one is given,
             e.g. a ServiceAccount token's: harness.chart_operator; `env` added to this process's;
             own process group, stdout and stderr appended to `log`; `peering`, e.g.
             ["--peering", "shapeshift", "--priority", "2"], replaces --standalone)
    operator_healthy(port)   its liveness endpoint answers 200
    stop_operator(process)   SIGTERM to the group, SIGKILL after a grace period
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

VENV_BIN = Path(sys.executable).parent


def start_operator(cluster, namespace: str, log: Path, port: int, *, kubeconfig: Path | None = None,
                   env: dict[str, str] | None = None, peering: list[str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(env or {}), "KUBECONFIG": str(kubeconfig or cluster.kubeconfig), "PYTHONSAFEPATH": "1"}
    cmd = [str(VENV_BIN / "shapeshift"), "operator", "--namespace", namespace,
           *(["--standalone"] if peering is None else peering),
           "--resync-seconds", "2", "--liveness", f"http://127.0.0.1:{port}/healthz"]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def operator_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop_operator(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
