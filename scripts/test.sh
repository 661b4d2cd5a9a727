#!/bin/sh
# `make test`: the whole suite as two pytest processes side by side. The server suite
# (tests/e2e/test_server.py: one node driven through every SDK stage, a third of the run's
# time, mostly waiting on its guests) runs beside everything else, whose output streams
# live; its own output follows at the end. Arguments: one pytest run of just those.
set -u
PY=${PY:-.venv/bin/python}
ARGS="-ra --durations=25"
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
"$PY" -m pytest $ARGS tests/e2e/test_server.py > "$LOG" 2>&1 &
server=$!
"$PY" -m pytest $ARGS --ignore=tests/e2e/test_server.py
rest=$?
wait "$server"
server_status=$?
echo "=== tests/e2e/test_server.py (run beside the above) ==="
cat "$LOG"
[ "$rest" -eq 0 ] && [ "$server_status" -eq 0 ]
