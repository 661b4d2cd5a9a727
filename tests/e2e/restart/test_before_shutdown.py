"""Before a graceful shutdown: running sandboxes with files and a process counting in memory.
test_server.py then stops the server with SIGTERM (which pauses them) and starts it again."""

import json
import os
from pathlib import Path

from e2b import Sandbox

COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; "
    "mv /tmp/counter.new /tmp/counter; sleep 0.1; done"
)


def test_sandboxes_running_at_shutdown() -> None:
    state = {}
    for n in range(2):
        sbx = Sandbox.create(timeout=600)
        sbx.files.write("/home/user/note.txt", f"note {n}")
        sbx.commands.run(COUNTER, background=True)
        sbx.commands.run("while [ ! -s /tmp/counter ]; do sleep 0.05; done", timeout=120)
        state[sbx.sandbox_id] = int(sbx.files.read("/tmp/counter"))
    Path(os.environ["AENV_HOME"], "shutdown.json").write_text(json.dumps(state))
