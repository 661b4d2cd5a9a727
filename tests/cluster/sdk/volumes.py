"""Runs in the gateway's namespace with the official e2b SDK pointed at a gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY), for volumes in a cluster. Prints one JSON line:

- `write NAME TEXT`: creates volume NAME and a sandbox mounting it, whose command writes TEXT
  into it; the sandbox's id, the volume's, and the file as envd reads it back.
- `read NAME`: a new sandbox mounting volume NAME; its id and the file it reads there.
- `destroy VOLUME_ID SANDBOX_ID...`: kills the sandboxes, then destroys the volume.
"""

from __future__ import annotations

import json
import sys

from e2b import Sandbox, Volume

FILE = "/mnt/data/shared.txt"


def write(name: str, text: str) -> dict[str, object]:
    volume = Volume.create(name)
    sandbox = Sandbox.create(timeout=600, volume_mounts={"/mnt/data": volume})
    sandbox.commands.run(f"echo {text} > {FILE}")
    read = sandbox.files.read(FILE)
    return {"id": sandbox.sandbox_id, "volume": volume.volume_id, "read": read}


def read(name: str) -> dict[str, object]:
    sandbox = Sandbox.create(timeout=600, volume_mounts={"/mnt/data": name})
    return {"id": sandbox.sandbox_id, "read": sandbox.files.read(FILE)}


def destroy(volume_id: str, sandbox_ids: list[str]) -> dict[str, object]:
    killed = [Sandbox.kill(sandbox_id) for sandbox_id in sandbox_ids]
    return {"killed": killed, "destroyed": Volume.destroy(volume_id)}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "write":
        result = write(args[0], args[1])
    elif command == "read":
        result = read(args[0])
    else:
        result = destroy(args[0], args[1:])
    print(json.dumps(result))
