"""Runs in the gateway's namespace with the official e2b SDK pointed at the gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY), for sandboxes that move between nodes. Prints one JSON line:

- `park TEXT`: a new sandbox with TEXT in a file, paused; its id.
- `create`: a new running sandbox; its id.
- `pause ID`: pauses it.
- `resume ID`: connects (resumes it wherever the gateway puts it); the file's TEXT and a
  command's output.
- `gone ID`: whether connecting to it is refused as not found.
"""

from __future__ import annotations

import json
import sys

from e2b import NotFoundException, Sandbox

FILE = "/home/user/moved.txt"


def park(text: str) -> dict[str, object]:
    sandbox = Sandbox.create("base", timeout=600, metadata={"suite": "moves"})
    sandbox.files.write(FILE, text)
    assert sandbox.pause() is True
    return {"id": sandbox.sandbox_id}


def create() -> dict[str, object]:
    return {"id": Sandbox.create("base", timeout=600, metadata={"suite": "moves"}).sandbox_id}


def resume(sandbox_id: str) -> dict[str, object]:
    sandbox = Sandbox.connect(sandbox_id, timeout=600)
    return {"file": sandbox.files.read(FILE), "echo": sandbox.commands.run("echo moved").stdout}


def gone(sandbox_id: str) -> dict[str, object]:
    try:
        Sandbox.connect(sandbox_id, timeout=600)
    except NotFoundException as error:
        return {"gone": True, "error": str(error)}
    return {"gone": False}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "park":
        result = park(args[0])
    elif command == "create":
        result = create()
    elif command == "pause":
        result = {"paused": Sandbox.pause(args[0])}
    elif command == "resume":
        result = resume(args[0])
    else:
        result = gone(args[0])
    print(json.dumps(result))
