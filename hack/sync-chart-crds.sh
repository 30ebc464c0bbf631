#!/usr/bin/env bash
# Copy the generated CRDs into the Helm chart:
#   crds/shapeshift.dev_*.yaml (hack/gen_crds.py) and crds/kopf.dev_*.yaml --> charts/shapeshift/crds/
# Helm installs charts/<chart>/crds/ before the templates (and never upgrades or deletes them).
#   hack/sync-chart-crds.sh          copy
#   hack/sync-chart-crds.sh --check  copy nothing; exit 1 naming the files that differ
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$REPO_ROOT/crds"
DST="$REPO_ROOT/charts/shapeshift/crds"

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

shopt -s nullglob
sources=("$SRC"/shapeshift.dev_*.yaml "$SRC"/kopf.dev_*.yaml)  # ours, and kopf's peering CRDs (--peering)
if (( ${#sources[@]} == 0 )); then
  echo "error: no CRDs in $SRC; run hack/gen_crds.py first" >&2
  exit 1
fi

stale=()
for src in "${sources[@]}"; do
  dst="$DST/$(basename "$src")"
  cmp -s "$src" "$dst" || stale+=("$dst")
done
for dst in "$DST"/*.yaml; do
  [[ -e "$SRC/$(basename "$dst")" ]] || stale+=("$dst (no longer generated)")
done

if (( check )); then
  if (( ${#stale[@]} )); then
    printf 'stale: %s\n' "${stale[@]}" >&2
    echo "run hack/sync-chart-crds.sh to update the chart's CRDs" >&2
    exit 1
  fi
  exit 0
fi

mkdir -p "$DST"
for dst in "$DST"/*.yaml; do
  [[ -e "$SRC/$(basename "$dst")" ]] || rm -f "$dst"
done
cp "${sources[@]}" "$DST/"
echo "copied ${#sources[@]} CRDs to $DST" >&2
