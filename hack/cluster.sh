#!/usr/bin/env bash
# A local Kubernetes control plane for development and tests, on loopback:
#   hack/cluster.sh up       build/check the binaries, start etcd, kube-apiserver,
#                            kube-controller-manager, kube-scheduler and kwok with the
#                            h200/trn2/cpu node pools; prints the KUBECONFIG to use
#   hack/cluster.sh env      prints `export KUBECONFIG=...` (use: eval "$(hack/cluster.sh env)")
#   hack/cluster.sh status   which processes run, whether /readyz answers
#   hack/cluster.sh down     stops the processes by their recorded PIDs, removes the state
# State lives in $SHAPESHIFT_CLUSTER_DIR (default $SHAPESHIFT_CACHE/cluster). The work is
# done by tests/harness/controlplane.py; pytest's `cluster` fixture starts its own.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ "${1:-}" == "up" ]]; then
  bash "$REPO_ROOT/hack/controlplane-deps.sh"
fi
[[ -x "$VENV/bin/python" ]] || { echo "error: no venv at $VENV; run bash hack/setup.sh" >&2; exit 1; }
exec "$VENV/bin/python" "$REPO_ROOT/tests/harness/controlplane.py" "$@"
