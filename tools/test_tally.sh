#!/usr/bin/env bash
# What a `pytest -v` log says so far, also when a timeout killed pytest before its summary: tests
# passed, skipped and failed, each test file reached, the failures by name, and pytest's own
# summary line when there is one.
#   usage: tools/test_tally.sh LOG
set -uo pipefail
log=${1:?usage: tools/test_tally.sh LOG}
[ -f "$log" ] || { echo "test_tally: no log at $log"; exit 2; }
# a test's verdict ends its line (after the test id, or alone after what the test printed); the
# short summary's "FAILED tests/...::name - why" lines do not
count() { grep -cE "(^| )$1( \(.*\))?$" "$log"; }
echo "tests: $(count PASSED) passed, $(count SKIPPED) skipped, $(( $(count FAILED) + $(count ERROR) )) failed or errors"
echo "files reached: $(grep -oE "^tests/[A-Za-z0-9_/]+\.py" "$log" | sort -u | xargs -r -n1 basename | tr '\n' ' ')"
grep -E "^(FAILED|ERROR) " "$log" | head -10
grep -E "^=+ .*(passed|failed|error|skipped).* =+$" "$log" | tail -1
exit 0  # a log with no failures or summary is an answer too
