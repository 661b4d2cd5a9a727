"""Runs in the gateway's namespace with the official e2b SDK pointed at the gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY), for templates built through it. Prints one JSON line:

- `build NAME CONTEXT`: `Template.build` of NAME from `base`, with a RUN step and a COPY of
  CONTEXT/app; the template's id.
- `doomed NAME`: `Template.build` of NAME with a step that runs for an hour, each build log
  line printed as it comes (`{"log": ...}`), then how the build ended (`{"error": ...}`).
- `from-template NAME`: a new sandbox from it; its id and the files the build made.
- `try-create NAME`: a new sandbox from it, killed at once; its id, or the SDK's error.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from e2b import Sandbox, Template
from e2b.template.logger import LogEntry


def build(name: str, context: str) -> dict[str, object]:
    template = (
        Template(file_context_path=context)
        .from_template("base")
        .run_cmd("echo built by a cluster node > /tmp/built.txt")
        .copy("app", "/home/user/app")
    )
    info = Template.build(template, alias=name)
    return {"templateID": info.template_id, "buildID": info.build_id}


def doomed(name: str) -> dict[str, object]:
    def logged(entry: LogEntry) -> None:
        print(json.dumps({"log": entry.message}), flush=True)

    template = Template().from_template("base").run_cmd("sleep 3600")
    try:
        info = Template.build(template, alias=name, on_build_logs=logged)
    except Exception as error:  # what the SDK raises when the build ends in error
        return {"error": str(error)}
    return {"templateID": info.template_id}


def from_template(name: str) -> dict[str, object]:
    sandbox = Sandbox.create(name, timeout=600, metadata={"suite": "builds"})
    run = sandbox.commands.run("cat /tmp/built.txt /home/user/app/hello.txt")
    return {"id": sandbox.sandbox_id, "files": run.stdout}


def try_create(name: str) -> dict[str, object]:
    try:
        sandbox = Sandbox.create(name, timeout=60)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    sandbox.kill()
    return {"id": sandbox.sandbox_id}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    commands: dict[str, Callable[..., dict[str, object]]] = {
        "build": build, "doomed": doomed, "from-template": from_template, "try-create": try_create,
    }  # fmt: skip
    print(json.dumps(commands[command](*args)))
