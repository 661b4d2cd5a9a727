"""Runs in the gateway's namespace with the official e2b SDK pointed at the gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY), for sandboxes that move between nodes. Prints one JSON line:

- `park TEXT`: a new sandbox with TEXT in a file, snapshotted (named `travels`) and paused; its
  id and the snapshot's.
- `from-snapshot REF`: a new sandbox from the snapshot; its id and the file's TEXT.
- `snapshots`: the ids of every snapshot, page by page (one per page).
- `delete-snapshot ID`: whether it was deleted.
- `create`: a new running sandbox; its id.
- `pause ID`: pauses it.
- `resume ID`: connects (resumes it wherever the gateway puts it); the file's TEXT and a
  command's output.
- `gone ID`: whether connecting to it is refused as not found.
- `fork ID COUNT`: writes TEXT into the sandbox, forks it COUNT times; each child's id and the
  file it read (or its error), then the children are killed.
- `listed`: this suite's sandboxes as `Sandbox.list` gives them, with their states.
"""

from __future__ import annotations

import json
import sys

from e2b import NotFoundException, Sandbox, SandboxQuery

FILE = "/home/user/moved.txt"


def park(text: str) -> dict[str, object]:
    sandbox = Sandbox.create("base", timeout=600, metadata={"suite": "moves"})
    sandbox.files.write(FILE, text)
    snapshot = sandbox.create_snapshot(name="travels")
    assert sandbox.pause() is True
    return {"id": sandbox.sandbox_id, "snapshot": snapshot.snapshot_id}


def from_snapshot(ref: str) -> dict[str, object]:
    sandbox = Sandbox.create(ref, timeout=600, metadata={"suite": "moves"})
    return {"id": sandbox.sandbox_id, "file": sandbox.files.read(FILE)}


def snapshots() -> dict[str, object]:
    paginator = Sandbox.list_snapshots(limit=1)
    ids: list[str] = []
    while paginator.has_next:
        ids += [s.snapshot_id for s in paginator.next_items()]
    return {"ids": ids}


def create() -> dict[str, object]:
    return {"id": Sandbox.create("base", timeout=600, metadata={"suite": "moves"}).sandbox_id}


def resume(sandbox_id: str) -> dict[str, object]:
    sandbox = Sandbox.connect(sandbox_id, timeout=600)
    return {"file": sandbox.files.read(FILE), "echo": sandbox.commands.run("echo moved").stdout}


def fork(sandbox_id: str, count: int) -> dict[str, object]:
    Sandbox.connect(sandbox_id, timeout=600).files.write(FILE, "forked state")
    children = Sandbox.fork(sandbox_id, count=count, timeout=600)
    seen: list[list[str]] = []
    for child in children:
        if isinstance(child, Sandbox):
            seen.append([child.sandbox_id, child.files.read(FILE)])
        else:
            seen.append(["", repr(child)])
    return {"children": seen}


def listed() -> dict[str, object]:
    pages = Sandbox.list(query=SandboxQuery(metadata={"suite": "moves"}))
    seen: list[list[str]] = []
    while pages.has_next:
        seen += [[s.sandbox_id, s.state.value] for s in pages.next_items()]
    return {"listed": sorted(seen)}


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
    elif command == "from-snapshot":
        result = from_snapshot(args[0])
    elif command == "snapshots":
        result = snapshots()
    elif command == "delete-snapshot":
        result = {"deleted": Sandbox.delete_snapshot(args[0])}
    elif command == "fork":
        result = fork(args[0], int(args[1]))
    elif command == "listed":
        result = listed()
    elif command == "create":
        result = create()
    elif command == "pause":
        result = {"paused": Sandbox.pause(args[0])}
    elif command == "resume":
        result = resume(args[0])
    else:
        result = gone(args[0])
    print(json.dumps(result))
