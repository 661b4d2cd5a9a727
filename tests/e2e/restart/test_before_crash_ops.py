"""Before the crash: a paused sandbox that must survive it, and a pause, a snapshot and a fork
still in flight when the server is killed (test_server.py kills it as this suite returns)."""

import json
import os
import threading
import time
from pathlib import Path

from e2b import Sandbox


def test_leave_work_in_flight() -> None:
    parked = Sandbox.create(timeout=600)
    parked.files.write("/home/user/parked.txt", "paused before the crash")
    assert parked.pause() is True
    busy = [Sandbox.create(timeout=600) for _ in range(3)]
    for sbx in busy:
        sbx.files.write("/home/user/busy.txt", sbx.sandbox_id)
    calls = [
        lambda: Sandbox.pause(busy[0].sandbox_id),
        lambda: Sandbox.create_snapshot(busy[1].sandbox_id, name="crash-snapshot"),
        lambda: Sandbox.fork(busy[2].sandbox_id, count=4, timeout=600),
    ]
    for call in calls:
        threading.Thread(target=call, daemon=True).start()
    Path(os.environ["AENV_HOME"], "crash-ops.json").write_text(
        json.dumps({"parked": parked.sandbox_id, "busy": [s.sandbox_id for s in busy]})
    )
    time.sleep(0.2)  # the requests reach the server; the crash comes while it works on them
