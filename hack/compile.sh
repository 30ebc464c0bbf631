#!/usr/bin/env bash
# Set up the Python environment if needed, then run the main job: a compile
# run that searches for a faster forward pass, measures it on a replay of a
# traffic profile, verifies it and stores the champion.
#   hack/compile.sh                      # embedded default: tiny-llama, chat profile, 12 trials
#   hack/compile.sh --model smollm2-135m --profile agentic-long-context --budget 15m
# Any `shapeshift compile` flag is passed through (`hack/compile.sh --help`).
# On a terminal it prints a line per phase and trial (engine/compile/progress.py), then one
# leaderboard and a last line naming the champion (or none), its baseline, bundle and report;
# with stdout not a terminal the progress goes to the log (stderr) as plain lines instead.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
"$REPO_ROOT/hack/setup.sh"
exec "$VENV/bin/shapeshift" compile "$@"
