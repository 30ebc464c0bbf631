# Shared settings for hack/ scripts. Source it, do not run it.
# SHAPESHIFT_CACHE holds everything big that is built or downloaded once:
# the Python virtual environment, pip's wheel cache, Go's module cache and
# the control-plane binaries. Reruns with a warm cache take seconds.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHAPESHIFT_CACHE="${SHAPESHIFT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/shapeshift}"
VENV="${SHAPESHIFT_VENV:-$SHAPESHIFT_CACHE/venv}"
export SHAPESHIFT_CACHE VENV REPO_ROOT
export PIP_CACHE_DIR="$SHAPESHIFT_CACHE/pip"
mkdir -p "$SHAPESHIFT_CACHE"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# The repository root holds a folder named `operator/`, which would shadow the
# standard library's `operator` module if the working directory landed on
# sys.path (as `python -m ...` does). Safe-path mode keeps it off.
export PYTHONSAFEPATH=1
# Control-plane binaries (etcd, kube-*, kwok) and the helm/kubectl/prometheus
# tools the cluster tests use all live in one directory outside the repository.
# tests/harness/tools.py reads the same variable.
SHAPESHIFT_BIN="${SHAPESHIFT_BIN:-$SHAPESHIFT_CACHE/bin}"
export SHAPESHIFT_BIN
