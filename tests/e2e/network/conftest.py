"""Client side of the network rules check (run by test_network.py inside the namespace)."""

from tests.e2e.inner.conftest import server

__all__ = ["server"]
