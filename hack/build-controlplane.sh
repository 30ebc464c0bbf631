#!/usr/bin/env bash
# Build the real control-plane binaries once and cache them in $SHAPESHIFT_BIN:
#   etcd (go.etcd.io/etcd/server/v3), kube-apiserver, kube-controller-manager,
#   kube-scheduler (k8s.io/kubernetes) and kwok (sigs.k8s.io/kwok).
#
# Data flow: Go module proxy -> $SHAPESHIFT_CACHE/go/mod (module cache)
#   -> one generated Go module in $SHAPESHIFT_CACHE/controlplane-src with a tiny
#      main package per binary -> `go build` (compile cache $SHAPESHIFT_CACHE/go/build)
#   -> $SHAPESHIFT_BIN/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kwok}.
#
# All five binaries are built from ONE module in ONE `go build`, so the packages
# they share (client-go, apimachinery, etcd client, ...) compile once. When the
# binaries for the pinned versions exist the script exits in well under a second;
# pass --force to rebuild anyway.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KUBE_VERSION="${KUBE_VERSION:-1.37.2}"   # newest v1.37.x on the module proxy when pinned
KWOK_VERSION="${KWOK_VERSION:-0.8.0}"    # newest sigs.k8s.io/kwok tag when pinned
# etcd: Kubernetes 1.37 itself requires the etcd client libraries at v3.7.0, and
# one module can hold only one version of go.etcd.io/etcd/*, so the server is
# built from the same release line (Debian's etcd-server is 3.4, too old).
ETCD_VERSION="${ETCD_VERSION:-3.7.0}"
GO="${GO:-/usr/local/go/bin/go}"
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

force=0
[[ "${1:-}" == "--force" ]] && force=1

stamp_file="$SHAPESHIFT_BIN/.controlplane-versions"
wanted="kubernetes=v$KUBE_VERSION etcd=v$ETCD_VERSION kwok=v$KWOK_VERSION"
all_present() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$SHAPESHIFT_BIN/$b" ]] || return 1; done
}
up_to_date() { all_present && [[ "$(cat "$stamp_file" 2>/dev/null)" == "$wanted" ]]; }
if (( ! force )) && up_to_date; then
  log "control-plane binaries up to date in $SHAPESHIFT_BIN ($wanted)"
  exit 0
fi
# One build at a time per cache (two test runs starting together would both build
# into the same source folder); whoever waited finds the binaries ready.
mkdir -p "$SHAPESHIFT_BIN"
exec 9>"$SHAPESHIFT_CACHE/.build-controlplane.lock"
flock 9
if (( ! force )) && up_to_date; then
  log "control-plane binaries were built meanwhile in $SHAPESHIFT_BIN ($wanted)"
  exit 0
fi

if [[ ! -x "$GO" ]]; then
  echo "error: Go not found at $GO; install Go >= 1.26 or set GO=/path/to/go" >&2
  exit 1
fi
export GOMODCACHE="$SHAPESHIFT_CACHE/go/mod" GOCACHE="$SHAPESHIFT_CACHE/go/build"
export CGO_ENABLED=0 GOFLAGS=-mod=mod
# Use the local toolchain; fail loudly instead of silently fetching another one.
export GOTOOLCHAIN=local
started=$(date +%s)
log "building $wanted with $("$GO" version) (cold: about 7 minutes on 2 cores, mostly compiling)"

src="$SHAPESHIFT_CACHE/controlplane-src"
rm -rf "$src"
mkdir -p "$src"/cmd/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kwok}
cd "$src"

# --- main packages, mirroring the upstream cmd/<name>/ entry points ---------
cat > cmd/etcd/main.go <<'GO'
// Command etcd is the etcd server, built from go.etcd.io/etcd/server/v3.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
for pair in "kube-apiserver:NewAPIServerCommand" \
            "kube-controller-manager:NewControllerManagerCommand" \
            "kube-scheduler:NewSchedulerCommand"; do
  name="${pair%%:*}" ctor="${pair##*:}"
  cat > "cmd/$name/main.go" <<GO
// Command $name is the upstream $name, built from k8s.io/kubernetes.
package main

import (
	"os"
	_ "time/tzdata" // CronJob time zones

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric
	"k8s.io/kubernetes/cmd/$name/app"
)

func main() { os.Exit(cli.Run(app.$ctor())) }
GO
done
cat > cmd/kwok/main.go <<'GO'
// Command kwok is the kwok controller (fake kubelets for fake nodes), built
// from sigs.k8s.io/kwok with the same flag setup as upstream cmd/kwok.
package main

import (
	"os"

	"github.com/spf13/pflag"

	"sigs.k8s.io/kwok/pkg/config"
	"sigs.k8s.io/kwok/pkg/kwok/cmd"
	"sigs.k8s.io/kwok/pkg/log"
	"sigs.k8s.io/kwok/pkg/utils/signals"
)

func main() {
	flags := pflag.NewFlagSet("global", pflag.ContinueOnError)
	flags.ParseErrorsAllowlist.UnknownFlags = true
	flags.Usage = func() {}
	ctx := signals.SetupSignalContext()
	ctx, logger := log.InitFlags(ctx, flags)
	ctx, err := config.InitFlags(ctx, flags)
	if err != nil {
		_, _ = os.Stderr.Write([]byte(flags.FlagUsages()))
		logger.Error("Init config flags", "err", err)
		os.Exit(1)
	}
	command := cmd.NewCommand(ctx)
	command.PersistentFlags().AddFlagSet(flags)
	if err := command.ExecuteContext(ctx); err != nil {
		logger.Error("Execute exit", "err", err)
		os.Exit(1)
	}
}
GO

# --- go.mod ------------------------------------------------------------------
"$GO" mod init shapeshift.local/controlplane >/dev/null 2>&1
kube_gomod="$("$GO" mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" \
  | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')"
[[ -f "$kube_gomod" ]] || { echo "error: could not download k8s.io/kubernetes@v$KUBE_VERSION" >&2; exit 1; }
# k8s.io/kubernetes requires its staging modules at v0.0.0 and points them at
# ./staging with replace lines that only apply inside its own repository. Pin
# each one to its published tag v0.<minor>.<patch>; the list comes from the
# module's own go.mod because staging modules are added between releases.
staging_version="0.${KUBE_VERSION#1.}"
edits=()
while read -r mod; do
  edits+=("-replace=$mod=$mod@v$staging_version")
done < <(sed -n 's|^[[:space:]]*\(k8s\.io/[a-z0-9-]*\) => \./staging/.*|\1|p' "$kube_gomod")
(( ${#edits[@]} > 10 )) || { echo "error: found only ${#edits[@]} staging modules in $kube_gomod" >&2; exit 1; }
# godebug lines only take effect in the main module: copy Kubernetes' default.
godebug="$(sed -n 's/^godebug[[:space:]]\{1,\}default=\(go[0-9.]*\)$/\1/p' "$kube_gomod")"
go_directive="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$kube_gomod")"
"$GO" mod edit "${edits[@]}" -go="$go_directive" ${godebug:+-godebug=default=$godebug} \
  -require="k8s.io/kubernetes@v$KUBE_VERSION" \
  -require="go.etcd.io/etcd/server/v3@v$ETCD_VERSION" \
  -require="sigs.k8s.io/kwok@v$KWOK_VERSION"
log "go.mod: ${#edits[@]} staging modules pinned at v$staging_version, godebug default=${godebug:-none}"
"$GO" mod tidy

# --- build ---------------------------------------------------------------------
# Stamp versions the way kubernetes/hack/lib/version.sh does, so /version and
# `kube-apiserver --version` report v$KUBE_VERSION instead of v0.0.0-master.
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=v$KUBE_VERSION -X $pkg.gitMajor=1"
  ldflags+=" -X $pkg.gitMinor=$(cut -d. -f2 <<<"$KUBE_VERSION") -X $pkg.gitTreeState=clean"
  ldflags+=" -X $pkg.buildDate=$build_date"
done
mkdir -p "$SHAPESHIFT_BIN"
staging_bin="$(mktemp -d "$SHAPESHIFT_BIN/.build.XXXXXX")"
trap 'rm -rf "$staging_bin"' EXIT
"$GO" build -trimpath -ldflags "$ldflags" -o "$staging_bin/" ./cmd/...
for b in "${BINARIES[@]}"; do mv -f "$staging_bin/$b" "$SHAPESHIFT_BIN/$b"; done
echo "$wanted" > "$stamp_file"
"$SHAPESHIFT_BIN/kube-apiserver" --version >&2
log "built ${BINARIES[*]} into $SHAPESHIFT_BIN in $(( $(date +%s) - started ))s"
