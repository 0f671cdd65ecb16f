#!/usr/bin/env bash
# `make test`'s pytest run: every test, its output kept in .mixplane/pytest-output.txt. When pytest itself dies of a
# signal (a native library's abort in the test process), the end of the output — all that CI shows — says in which
# test, what the library printed just before, and the Python stack of the thread that died.
set -u
PY=${1:?usage: run-tests.sh PYTHON [pytest args]}
shift
mkdir -p .mixplane
log=.mixplane/pytest-output.txt
export MIXPLANE_TEST_LAST=.mixplane/pytest-last
rm -f "$MIXPLANE_TEST_LAST"
"$PY" -m pytest "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -gt 128 ] || grep -q "Fatal Python error" "$log"; then
    echo "=== pytest died (exit $rc) in: $(cat "$MIXPLANE_TEST_LAST" 2>/dev/null || echo 'no test started')"
    echo "=== what came before the fatal error:"
    grep -B 12 -m 1 "Fatal Python error" "$log" | cut -c1-300
    echo "=== the thread that died:"
    awk '/^Current thread/{p=1} p&&/^$/{exit} p' "$log" | head -40
fi
exit "$rc"
