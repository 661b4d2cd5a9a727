"""`python -m aenv.code_interpreter`: the server, on port 49999 of every address."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from aenv.code_interpreter.app import create_app
from aenv.code_interpreter.kernels import ContextTable

PORT = 49999


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    app = create_app(ContextTable(args.cwd, spares=not args.no_spare))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
