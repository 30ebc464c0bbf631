#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
#   hack/test.sh                 # the whole suite
#   hack/test.sh tests/engine -k smollm2   # any pytest arguments
# Big downloads and builds are cached under $SHAPESHIFT_CACHE
# (default ~/.cache/shapeshift), so a second run starts testing in seconds.
# Exits with pytest's status; 5 (no tests collected) is a failure too.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

bash "$REPO_ROOT/hack/setup.sh"
bash "$REPO_ROOT/hack/controlplane-deps.sh"

cd "$REPO_ROOT"
rc=0
"$VENV/bin/pytest" "$@" || rc=$?
if [[ $rc -eq 5 ]]; then
  log "pytest collected no tests"
fi
exit $rc
