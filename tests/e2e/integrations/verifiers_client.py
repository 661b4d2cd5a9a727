"""Runs in verifiers' own environment (scripts/install-integrations.sh), in the server's
namespace with the E2B settings pointed at the server: `verifiers_client.py IMAGE` drives
verifiers' unmodified E2B runtime (`verifiers.v1.runtimes.e2b.E2BRuntime`) through what a
rollout does with it: the template built from IMAGE, a sandbox started, commands (a failing
one, an env, the durable program runner, a live process with stdin), a binary file written
and read back, a capped read, the egress policy applied before the agent, a port exposed, and
the teardown. Prints one JSON line of what it saw."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from verifiers.v1.runtimes.e2b import E2BConfig, E2BRuntime

BINARY = bytes(range(256))


async def drive(image: str) -> dict[str, Any]:
    config = E2BConfig(image=image, cpu=1, memory=0.5, creates_per_sec=None, allow=["example.com"])
    runtime = E2BRuntime(config, name="aenv-integration")
    seen: dict[str, Any] = {}
    await runtime.start()
    try:
        seen["template"] = runtime.info.template
        seen["sandbox"] = runtime.info.id
        failed = await runtime.run(["sh", "-c", "echo out; echo err >&2; exit 3"], {})
        seen["run"] = [failed.exit_code, failed.stdout, failed.stderr]
        env = await runtime.run(["sh", "-c", 'echo "$GREETING in $PWD as $(id -u)"'],
                                {"GREETING": "hello"})  # fmt: skip
        seen["env"] = env.stdout
        program = await runtime.run_program(["sh", "-c", "echo program; exit 5"], {})
        seen["program"] = [program.exit_code, program.stdout]
        await runtime.write("data/blob.bin", BINARY)
        seen["read_back"] = await runtime.read("data/blob.bin") == BINARY
        try:
            await runtime.read("data/blob.bin", max_bytes=16)
            seen["capped"] = "not refused"
        except Exception as error:  # verifiers' SandboxError: over the limit
            seen["capped"] = type(error).__name__
        process = await runtime.open_process(["sh", "-c", "read line; echo got $line"], {})
        await process.write(b"a line\n")
        out = b"".join([chunk async for chunk in process.stdout])
        seen["process"] = [await process.wait(), out.decode("latin-1")]
        seen["alive"] = await runtime.alive()
        await runtime.prepare_execution([])
        seen["expose"] = await runtime.expose(8000)
    finally:
        await runtime.stop()
    seen["stopped"] = runtime._sandbox is None
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(drive(sys.argv[1]))))
