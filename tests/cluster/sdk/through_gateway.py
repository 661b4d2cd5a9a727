"""Runs in the gateway's namespace with the official e2b SDK pointed at the gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY): `create N PAUSE` makes N sandboxes, PAUSE seconds apart, and uses
each one's commands and files; `kill ID...` kills them; `burst N` asks for N sandboxes at once
(the ids made and the errors, by SDK exception and status). Prints one JSON line of what it
saw."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from e2b import RateLimitException, Sandbox, SandboxQuery


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


def burst(count: int) -> dict[str, object]:
    def one(_: int) -> str:
        try:
            return Sandbox.create("base", timeout=600, metadata={"suite": "burst"}).sandbox_id
        except RateLimitException:
            return "429"
        except Exception as error:
            return f"{type(error).__name__}: {error}"

    with ThreadPoolExecutor(count) as pool:
        answers = list(pool.map(one, range(count)))
    made = [a for a in answers if a != "429" and ":" not in a]
    return {"ids": made, "errors": sorted(a for a in answers if a not in made)}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "create":
        result = create(int(args[0]), float(args[1]))
    elif command == "burst":
        result = burst(int(args[0]))
    else:
        result = kill(args)
    print(json.dumps(result))
