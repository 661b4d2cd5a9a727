"""Runs inside the server's namespace (test_volumes.py), against the server `inner/` uses."""

from tests.e2e.inner.conftest import server

__all__ = ["server"]
