#!/usr/bin/env bash
# Run the Shapeshift operator from this checkout, in the foreground, against the cluster of
# the current kubeconfig (kind, minikube, hack/cluster.sh's local control plane), before or
# instead of installing the Helm chart. docs/local-operator.md walks through it.
#   hack/run-operator-local.sh                            # the kubeconfig's namespace (or default)
#   hack/run-operator-local.sh -n team-a -n team-b        # or -A: every namespace
#   hack/run-operator-local.sh --kubeconfig ~/.kube/kind.yaml --prometheus-url http://127.0.0.1:9090
#   hack/run-operator-local.sh --local-pods               # hack/cluster.sh up: its CPU pods run here too
# Steps: set up the Python environment (hack/setup.sh), check that the API server answers,
# apply the CRDs in crds/ (kubectl apply --server-side; with --local-pods generated with the runner's
# folder as a further artifact root) and wait until they are Established,
# then exec `shapeshift operator --standalone` with the remaining flags. Ctrl-C stops it.
#   --kubeconfig PATH      use this kubeconfig (default: $KUBECONFIG, then ~/.kube/config)
#   --prometheus-url URL   where the drift detector reads traffic (SHAPESHIFT_PROMETHEUS_URL;
#                          spec.prometheusUrl of an InferenceDeployment overrides it)
#   --no-crds              do not apply crds/ (they are installed already, e.g. by the chart)
#   --local-pods           also run hack/run-pods-local.py in the background (same kubeconfig and
#                          namespaces): the CPU pool's pods of hack/cluster.sh's control plane run as
#                          local processes; it stops when the operator does (and the operator with it)
#   --port-base N, --workdir DIR, --pool NAME, --interval S   (with --local-pods) the runner's options
# Every other flag goes to `shapeshift operator` (`shapeshift operator --help`); without
# --liveness, the health endpoint is http://127.0.0.1:${SHAPESHIFT_OPERATOR_HEALTH_PORT:-18080}/healthz.
# kubectl: $KUBECTL, else the one on PATH, else $SHAPESHIFT_BIN/kubectl.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

apply_crds=1
local_pods=0
operator_args=()
pods_args=()
runner_opts=()
scoped=0
liveness=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --kubeconfig) [[ $# -ge 2 ]] || { echo "error: --kubeconfig needs a path" >&2; exit 2; }
                  export KUBECONFIG="$2"; shift 2 ;;
    --kubeconfig=*) export KUBECONFIG="${1#*=}"; shift ;;
    --prometheus-url) [[ $# -ge 2 ]] || { echo "error: --prometheus-url needs a URL" >&2; exit 2; }
                      export SHAPESHIFT_PROMETHEUS_URL="$2"; shift 2 ;;
    --prometheus-url=*) export SHAPESHIFT_PROMETHEUS_URL="${1#*=}"; shift ;;
    --no-crds) apply_crds=0; shift ;;
    -n|--namespace) [[ $# -ge 2 ]] || { echo "error: $1 needs a namespace" >&2; exit 2; }
                    scoped=1; operator_args+=("$1" "$2"); pods_args+=("$1" "$2"); shift 2 ;;
    -A|--all-namespaces|--namespace=*) scoped=1; operator_args+=("$1"); pods_args+=("$1"); shift ;;
    --liveness|--liveness=*) liveness=1; operator_args+=("$1"); shift ;;
    --local-pods) local_pods=1; shift ;;
    --port-base|--workdir|--pool|--interval)
      [[ $# -ge 2 ]] || { echo "error: $1 needs a value" >&2; exit 2; }
      runner_opts+=("$1"); pods_args+=("$1" "$2"); shift 2 ;;
    --port-base=*|--workdir=*|--pool=*|--interval=*) runner_opts+=("${1%%=*}"); pods_args+=("$1"); shift ;;
    -h|--help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) operator_args+=("$1"); shift ;;
  esac
done
if [[ "$local_pods" == 0 && ${#runner_opts[@]} -gt 0 ]]; then
  echo "error: ${runner_opts[*]}: options of hack/run-pods-local.py, which only --local-pods starts" >&2
  exit 2
fi
if [[ -n "${KUBECONFIG:-}" ]]; then
  first="${KUBECONFIG%%:*}"
  [[ -f "$first" ]] || { echo "error: kubeconfig $first does not exist" >&2; exit 2; }
  export KUBECONFIG="$(realpath "$first")${KUBECONFIG#"$first"}"
elif [[ ! -f "$HOME/.kube/config" ]]; then
  echo "error: no kubeconfig: set KUBECONFIG, pass --kubeconfig, or start a cluster (kind create cluster," \
       "minikube start, or hack/cluster.sh up and eval \"\$(hack/cluster.sh env)\")" >&2
  exit 2
fi

"$REPO_ROOT/hack/setup.sh"

kubectl="${KUBECTL:-$(command -v kubectl || true)}"
[[ -n "$kubectl" ]] || kubectl="$SHAPESHIFT_BIN/kubectl"
[[ -x "$kubectl" ]] || { echo "error: kubectl not found (\$KUBECTL, PATH, $SHAPESHIFT_BIN);" \
                               "install it, or run hack/controlplane-deps.sh" >&2; exit 2; }

context="$("$kubectl" config current-context 2>/dev/null || echo '?')"
if ! "$kubectl" version --request-timeout=10s >/dev/null 2>&1; then
  echo "error: the API server of context '$context' does not answer (kubectl version failed);" \
       "is the cluster running?" >&2
  exit 1
fi

if [[ "$scoped" == 0 ]]; then
  ns="$("$kubectl" config view --minify -o jsonpath='{..namespace}' 2>/dev/null || true)"
  operator_args=(--namespace "${ns:-default}" "${operator_args[@]}")
  pods_args=(--namespace "${ns:-default}" "${pods_args[@]}")
fi
if [[ "$liveness" == 0 ]]; then
  operator_args+=(--liveness "http://127.0.0.1:${SHAPESHIFT_OPERATOR_HEALTH_PORT:-18080}/healthz")
fi

# With --local-pods the runner's folders stand in for the pods' artifact store and work folder, and
# the compile worker records their local paths in the ForwardPasses it publishes: the operator, the
# runner's processes and the CRDs applied here accept local artifact paths under that folder too
# (SHAPESHIFT_ARTIFACT_ROOTS, operator/api/forward_pass.py); crds/ itself names the pods' mounts only.
if [[ "$local_pods" == 1 ]]; then
  workdir="$SHAPESHIFT_CACHE/local-pods"
  for ((i = 0; i < ${#pods_args[@]}; i++)); do
    case "${pods_args[i]}" in
      --workdir) workdir="${pods_args[i+1]}" ;;
      --workdir=*) workdir="${pods_args[i]#*=}" ;;
    esac
  done
  export SHAPESHIFT_ARTIFACT_ROOTS="${SHAPESHIFT_ARTIFACT_ROOTS:+$SHAPESHIFT_ARTIFACT_ROOTS,}$(realpath -m "$workdir")"
fi

if [[ "$apply_crds" == 1 ]]; then
  crd_dir="$REPO_ROOT/crds"
  if [[ -n "${SHAPESHIFT_ARTIFACT_ROOTS:-}" ]]; then
    crd_dir="$SHAPESHIFT_CACHE/crds-local"
    roots=()
    IFS=',' read -ra parts <<< "$SHAPESHIFT_ARTIFACT_ROOTS"
    for root in "${parts[@]}"; do roots+=(--artifact-root "$root"); done
    "$VENV/bin/python" "$REPO_ROOT/hack/gen_crds.py" --out "$crd_dir" "${roots[@]}" >/dev/null
    log "applying the CRDs of crds/, local artifact paths also under $SHAPESHIFT_ARTIFACT_ROOTS, to context '$context'"
  else
    log "applying the CRDs in crds/ to context '$context'"
  fi
  "$kubectl" apply --server-side --force-conflicts -f "$crd_dir/" >/dev/null
  "$kubectl" wait --for=condition=Established --timeout=60s \
    crd/inferencedeployments.shapeshift.dev crd/compileruns.shapeshift.dev crd/forwardpasses.shapeshift.dev >/dev/null
fi

log "running the operator from $REPO_ROOT against context '$context': shapeshift operator --standalone ${operator_args[*]}"
if [[ "$local_pods" == 0 ]]; then
  exec "$VENV/bin/shapeshift" operator --standalone "${operator_args[@]}"
fi

# --local-pods: the operator and the runner side by side, their lines interleaved on this terminal.
# Whichever ends first (or Ctrl-C, or SIGTERM to this script) stops the other; the runner stops
# the processes it started and reports them to the API before it exits.
log "running the CPU pool's pods as local processes: hack/run-pods-local.py ${pods_args[*]}"
"$VENV/bin/python" "$REPO_ROOT/hack/run-pods-local.py" "${pods_args[@]}" &
pods_pid=$!
"$VENV/bin/shapeshift" operator --standalone "${operator_args[@]}" &
operator_pid=$!
stopped=0
stop_both() {
  [[ "$stopped" == 1 ]] && return
  stopped=1
  kill -TERM "$operator_pid" "$pods_pid" 2>/dev/null || true
  wait "$operator_pid" 2>/dev/null || true
  wait "$pods_pid" 2>/dev/null || true
  log "stopped the operator and the local pods runner"
}
trap 'stop_both; exit 130' INT
trap 'stop_both; exit 143' TERM
trap stop_both EXIT
rc=0
wait -n "$operator_pid" "$pods_pid" || rc=$?
if kill -0 "$operator_pid" 2>/dev/null; then
  log "hack/run-pods-local.py ended (exit $rc); stopping the operator"
else
  log "the operator ended (exit $rc); stopping the local pods runner"
fi
exit "$rc"
