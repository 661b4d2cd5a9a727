"""Runs in the gateway's namespace with the official e2b SDK pointed at the gateway (E2B_API_URL,
E2B_SANDBOX_URL, E2B_API_KEY), for templates built through it. Prints one JSON line:

- `build NAME CONTEXT`: `Template.build` of NAME from `base`, with a RUN step and a COPY of
  CONTEXT/app; the template's id.
- `from-template NAME`: a new sandbox from it; its id and the files the build made.
"""

from __future__ import annotations

import json
import sys

from e2b import Sandbox, Template


def build(name: str, context: str) -> dict[str, object]:
    template = (
        Template(file_context_path=context)
        .from_template("base")
        .run_cmd("echo built by a cluster node > /tmp/built.txt")
        .copy("app", "/home/user/app")
    )
    info = Template.build(template, alias=name)
    return {"templateID": info.template_id, "buildID": info.build_id}


def from_template(name: str) -> dict[str, object]:
    sandbox = Sandbox.create(name, timeout=600, metadata={"suite": "builds"})
    run = sandbox.commands.run("cat /tmp/built.txt /home/user/app/hello.txt")
    return {"id": sandbox.sandbox_id, "files": run.stdout}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    result = build(args[0], args[1]) if command == "build" else from_template(args[0])
    print(json.dumps(result))
