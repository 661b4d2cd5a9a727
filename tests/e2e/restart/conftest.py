"""Client side of the crash-and-restart check (run by test_server.py inside the namespace)."""

from tests.e2e.inner.conftest import server

__all__ = ["server"]
