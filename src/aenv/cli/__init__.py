"""The `aenv` command line."""

from aenv.cli.main import app, main

__all__ = ["app", "main"]
