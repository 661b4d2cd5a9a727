import json
import os
from pathlib import Path

from e2b import Sandbox


def test_create_sandboxes_the_crash_will_orphan() -> None:
    ids = [Sandbox.create(timeout=600).sandbox_id for _ in range(2)]
    Path(os.environ["AENV_HOME"], "crash-ids.json").write_text(json.dumps(ids))
