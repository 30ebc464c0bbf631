#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run it.
#   hack/test.sh                 # the whole suite
#   hack/test.sh tests/engine -k smollm2   # any pytest arguments
# Big downloads and builds are cached under $SHAPESHIFT_CACHE
# (default ~/.cache/shapeshift), so a second run starts testing in seconds.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$REPO_ROOT/hack/setup.sh"
if [[ -x "$REPO_ROOT/hack/controlplane-deps.sh" ]]; then
  "$REPO_ROOT/hack/controlplane-deps.sh"
fi

cd "$REPO_ROOT"
set +e
"$VENV/bin/pytest" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  log "pytest collected no tests"
fi
exit $rc
