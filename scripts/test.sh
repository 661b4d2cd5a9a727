#!/bin/sh
# `make test`: the whole suite as two pytest processes side by side. The server lane holds the
# server suite (tests/e2e/test_server.py: one node driven through every SDK stage, mostly
# waiting on its guests) and the cluster suite (gateways and nodes in their own namespaces,
# also mostly waiting); everything else runs beside it, its output streaming live. The lanes
# took 17.5 and 32 min apart in the last full runs: the cluster suite (4-7 min) moved to even
# them out. The server lane's output follows at the end. Arguments: one pytest run of just
# those.
set -u
PY=${PY:-.venv/bin/python}
ARGS="-ra --durations=25"
# The gateway cluster test (≈ 3 min of real VMs) runs in the main lane, which ended 6 min before
# this one in the last full run (24.5 and 30.4 min).
SERVER_LANE="tests/e2e/test_server.py $(ls tests/cluster/test_*.py | grep -v /test_gateway_cluster.py)"
# The project's own bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) every Python process the tests start (servers, CLI calls, envds, SDK scripts) would
# compile what it imports of src/ and tests/ again, ≈ 1 s of CPU for a server's imports.
"$PY" -m compileall -q src tests > /dev/null || exit 1
if [ $# -gt 0 ]; then
    exec "$PY" -m pytest $ARGS "$@"
fi
"$PY" -m tests.support.prepare || exit 1
LOG=build/test-server.log
mkdir -p build
# shellcheck disable=SC2086 # the lane's paths split on spaces
"$PY" -m pytest $ARGS $SERVER_LANE > "$LOG" 2>&1 &
server=$!
# shellcheck disable=SC2086
"$PY" -m pytest $ARGS $(printf -- '--ignore=%s ' $SERVER_LANE)
rest=$?
wait "$server"
server_status=$?
echo "=== $SERVER_LANE (run beside the above) ==="
cat "$LOG"
[ "$rest" -eq 0 ] && [ "$server_status" -eq 0 ]
