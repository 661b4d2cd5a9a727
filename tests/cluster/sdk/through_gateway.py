"""Runs in the gateway's namespace with the official e2b SDK pointed at the gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY): `create N PAUSE` makes N sandboxes, PAUSE seconds apart, and uses
each one's commands and files; `kill ID...` kills them. Prints one JSON line of what it saw."""

from __future__ import annotations

import json
import sys
import time

from e2b import Sandbox, SandboxQuery


def listed(tag: str) -> list[str]:
    pages = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
    seen: list[str] = []
    while pages.has_next:
        seen += [s.sandbox_id for s in pages.next_items()]
    return seen


def create(count: int, pause: float) -> dict[str, object]:
    made, outputs, files = [], [], []
    for index in range(count):
        if index:
            time.sleep(pause)  # a heartbeat in between: the nodes' reports show the new load
        sandbox = Sandbox.create("base", timeout=600, metadata={"suite": "gateway"})
        made.append(sandbox.sandbox_id)
        outputs.append(sandbox.commands.run(f"echo hello {index}").stdout)
        sandbox.files.write("notes/a.txt", f"note {index}")
        files.append(sandbox.files.read("notes/a.txt"))
    return {"ids": made, "outputs": outputs, "files": files, "listed": listed("gateway")}


def kill(ids: list[str]) -> dict[str, object]:
    killed = [Sandbox.kill(sandbox_id) for sandbox_id in ids]
    return {"killed": killed, "listed": listed("gateway")}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    result = create(int(args[0]), float(args[1])) if command == "create" else kill(args)
    print(json.dumps(result))
