#!/usr/bin/env bash
# For machines WITH Docker: a kind cluster carrying the same fake node pools as the
# local control plane (h200, trn2, cpu), so the same tests run against it:
#   hack/kind-up.sh [cluster-name]        then
#   SHAPESHIFT_TEST_KUBECONFIG=$SHAPESHIFT_CACHE/kind-<name>.kubeconfig pytest -m cluster ...
# Needs docker, kind, and network access to kwok's release manifests on GitHub.
# Set KIND_IMAGE=kindest/node:v1.37.<x> so the server matches the tests' v1.37 check.
# The pools are kwok Nodes created by tests/harness/controlplane.py's definitions,
# and kwok runs inside the cluster with the same stages (pods stop at Running).
# Not exercised in CI, which has no Docker: treat as a starting point.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
name="${1:-shapeshift}"
KWOK_VERSION="${KWOK_VERSION:-v0.8.0}"
kubeconfig="$SHAPESHIFT_CACHE/kind-$name.kubeconfig"
for tool in docker kind; do
  command -v "$tool" >/dev/null || { echo "error: $tool not found; kind-up.sh needs Docker and kind" >&2; exit 1; }
done
kubectl="$SHAPESHIFT_BIN/kubectl"
[[ -x "$kubectl" ]] || bash "$REPO_ROOT/hack/controlplane-deps.sh"

kind get clusters 2>/dev/null | grep -qx "$name" || kind create cluster --name "$name" --kubeconfig "$kubeconfig" --wait 120s ${KIND_IMAGE:+--image "$KIND_IMAGE"}
k() { "$kubectl" --kubeconfig "$kubeconfig" "$@"; }

# kwok in the cluster: its controller and CRDs from the release, then our stages
# (no pod-complete stage) instead of the release's default ones.
k apply -f "https://github.com/kubernetes-sigs/kwok/releases/download/$KWOK_VERSION/kwok.yaml"
k wait --for=condition=Established crd/stages.kwok.x-k8s.io --timeout=60s
"$VENV/bin/python" - "$REPO_ROOT/tests" <<'PY' | k apply -f -
import sys, yaml
sys.path.insert(0, sys.argv[1])
from harness.controlplane import DEFAULT_POOLS, stages_yaml
nodes = [node for pool in DEFAULT_POOLS for node in pool.node_manifests()]
print(stages_yaml() + "---\n" + yaml.safe_dump_all(nodes, sort_keys=False))
PY
k -n kube-system rollout status deployment/kwok-controller --timeout=120s
k wait --for=condition=Ready node -l type=kwok --timeout=120s
echo "export SHAPESHIFT_TEST_KUBECONFIG=$kubeconfig"
