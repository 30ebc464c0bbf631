#!/usr/bin/env python3
"""Run the pods that kwok's CPU nodes hold as local processes: a kubelet for hack/cluster.sh.

    hack/cluster.sh up && eval "$(hack/cluster.sh env)"
    hack/run-operator-local.sh                 # in one terminal
    hack/run-pods-local.py                     # in another: the kubeconfig's namespace (or default)
    hack/run-pods-local.py -n team-a -n team-b # or -A: every namespace

hack/cluster.sh's nodes are kwok's: the scheduler places pods and kwok reports them Running,
but nothing runs. This runs, every --interval seconds, each pod bound to a node of the --pool
pools (default: cpu) in the watched namespaces, the way the test suite does
(tests/harness/local_pods.py, tests/harness/kubelet.py):

  - engine pods (`shapeshift serve ...`): the pod's own command line, with --host and --port
    replaced by 127.0.0.1 and the first free port from --port-base (default 18000) up; the
    URL is printed (and listed in <workdir>/endpoints.json): curl it, not the Service; and
    <workdir>/prometheus-targets.json lists the engines for a Prometheus file_sd_configs
    (labels namespace, deployment, pod, as a ServiceMonitor writes them);
  - other pods (a compile Job's `shapeshift compile --compile-run NS/RUN`): as written;
  - env, ConfigMap/Secret/downward-API values and downwardAPI volumes as a kubelet gives them;
    a persistentVolumeClaim volume is the folder <workdir>/claims/<namespace>/<claim>;
  - a process's exit is reported to the pod's status (Succeeded/Failed, exit code), as a kubelet
    reports it; a deleted pod's processes get SIGTERM (SIGKILL after 10 s).
Not done: images (processes run from this checkout's venv, so `shapeshift` is this checkout's),
restarts, probes, configMap volumes (the engine reads its flags, not the mounted engine.yaml),
Services and port-forward (kwok's pod IPs route nowhere), GPU and Trainium pools.

Options: --kubeconfig PATH (default $KUBECONFIG, then ~/.kube/config), -n NS (repeatable), -A,
--pool NAME (repeatable), --port-base N, --workdir DIR (default $SHAPESHIFT_CACHE/local-pods),
--interval S. Ctrl-C (or SIGTERM) stops every process it started and reports them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SHAPESHIFT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
             / "shapeshift")
VENV_PYTHON = Path(os.environ.get("SHAPESHIFT_VENV") or CACHE / "venv") / "bin" / "python"

try:
    import kubernetes  # noqa: F401
except ImportError:  # run with a python that is not the project's venv: re-run with the venv's
    if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV_PYTHON.parents[1].resolve():
        os.environ["PYTHONSAFEPATH"] = "1"
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), __file__, *sys.argv[1:]])
    sys.exit(f"error: the kubernetes client is not installed; run bash hack/setup.sh (venv {VENV_PYTHON})")

sys.path.insert(0, str(REPO / "tests"))  # the local kubelet (tests/harness)

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hack/run-pods-local.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog="docs/local-operator.md walks through it.")
    parser.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, then ~/.kube/config)")
    parser.add_argument("-n", "--namespace", action="append", dest="namespaces", metavar="NS",
                        help="a namespace to run pods of (repeatable; default: the context's, else default)")
    parser.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    parser.add_argument("--pool", action="append", dest="pools", metavar="NAME",
                        help="run pods bound to nodes of this pool (label shapeshift.dev/pool; repeatable; default cpu)")
    parser.add_argument("--port-base", type=int, default=18000, help="first loopback port for engines (default 18000)")
    parser.add_argument("--workdir", type=Path, default=CACHE / "local-pods",
                        help="logs, downward-API files, claim folders, endpoints.json (default $SHAPESHIFT_CACHE/local-pods)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between looks at the API (default 1)")
    args = parser.parse_args(argv)
    if args.all_namespaces and args.namespaces:
        parser.error("give -n or -A, not both")
    if not 1 <= args.port_base <= 65535:
        parser.error("--port-base must be a port number")
    return args


def write_atomically(path: Path, text: str) -> None:
    """Readers (curl scripts, Prometheus's file_sd) never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import kubernetes  # noqa: F811  (imported above only to find the venv)
    from kubernetes.config.config_exception import ConfigException

    from harness.local_pods import DEFAULT_POOLS, LocalPodRunner

    config_file = args.kubeconfig or (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or None
    try:
        api_client = kubernetes.config.new_client_from_config(config_file=config_file)
        _, context = kubernetes.config.list_kube_config_contexts(config_file=config_file)
    except (ConfigException, FileNotFoundError) as error:
        print(f"error: no usable kubeconfig ({error}); pass --kubeconfig, set KUBECONFIG, or run "
              "hack/cluster.sh up and eval \"$(hack/cluster.sh env)\"", file=sys.stderr)
        return 2
    namespaces = None if args.all_namespaces else (
        args.namespaces or [context.get("context", {}).get("namespace") or "default"])
    args.workdir.mkdir(parents=True, exist_ok=True)
    endpoints = args.workdir / "endpoints.json"
    targets = args.workdir / "prometheus-targets.json"

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)

    runner = LocalPodRunner(api_client, namespaces, args.workdir, pools=tuple(args.pools or DEFAULT_POOLS),
                            port_base=args.port_base, extra_env={"SHAPESHIFT_CACHE": str(CACHE)}, log=log)
    try:
        kubernetes.client.CoreV1Api(api_client).list_node(limit=1, _request_timeout=10)
    except Exception as error:  # noqa: BLE001  any failure here means the same thing to the user
        print(f"error: the API server of context {context.get('name', '?')!r} does not answer ({error});"
              " is the cluster running?", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    log(f"running the pods of {', '.join(namespaces) if namespaces else 'every namespace'} on the "
        f"{', '.join(runner.pools)} pool(s); engines from 127.0.0.1:{args.port_base}; Ctrl-C stops them")
    written, failure = None, None
    try:
        while not stop.is_set():
            try:
                runner.sync()
                failure = None
            except Exception as error:  # noqa: BLE001  the API server restarting ends nothing
                said = f"{error.__class__.__name__}: {str(error)[:200]}"
                if said != failure:  # once, not every pass
                    log(f"looking at the API failed ({said}); retrying")
                failure = said
            urls = runner.urls()
            if urls != written:
                write_atomically(endpoints, json.dumps(urls, indent=2, sort_keys=True) + "\n")
                write_atomically(targets, json.dumps(runner.prometheus_targets(), indent=2) + "\n")
                written = urls
            stop.wait(args.interval)
    finally:
        runner.stop_all()
        write_atomically(endpoints, "{}\n")
        write_atomically(targets, "[]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
