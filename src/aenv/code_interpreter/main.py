"""`python -m aenv.code_interpreter`: the server, on port 49999 of every address."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from aenv.code_interpreter.app import create_app
from aenv.code_interpreter.kernels import ContextTable
from aenv.code_interpreter.languages import LANGUAGES
from aenv.code_interpreter.sandbox_env import ENVD_URL, SandboxEnv

PORT = 49999
# E2B's server starts these two.
DEFAULT_LANGUAGES = "python,javascript"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aenv.code_interpreter")
    parser.add_argument("--host", default="0.0.0.0")  # noqa: S104
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--cwd", default="/home/user", help="the default contexts' directory")
    parser.add_argument(
        "--no-spare",
        action="store_true",
        help="keep no spare Python kernel: saves a kernel's memory, and a new context waits"
        " for its kernel to start",
    )
    parser.add_argument(
        "--envd-url",
        default=ENVD_URL,
        help="where envd tells the sandbox's env vars; empty: nowhere, kernels get none",
    )
    parser.add_argument(
        "--default-contexts",
        default=DEFAULT_LANGUAGES,
        help="the languages whose default context starts with the server, comma-separated"
        " (python always): their first cells wait for no kernel start",
    )
    args = parser.parse_args(argv)
    languages = ["python", *(n for n in args.default_contexts.split(",") if n and n != "python")]
    if unknown := [name for name in languages if name not in LANGUAGES]:
        parser.error(f"--default-contexts: unknown language {unknown[0]!r}")
    try:
        sandbox_env = SandboxEnv(args.envd_url or None)
    except ValueError as e:
        parser.error(f"--envd-url: {e}")
    logging.basicConfig(level=logging.INFO)
    table = ContextTable(args.cwd, spares=not args.no_spare)
    app = create_app(table, sandbox_env, languages)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
