"""Runs with an older e2b SDK (2.45, the last before the v2 create/connect routes), in its own
virtual environment inside the server's namespace; see test_server.py."""

from tests.e2e.inner.conftest import server

__all__ = ["server"]
