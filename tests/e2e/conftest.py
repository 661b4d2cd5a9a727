"""The SDK suites under `inner/` run inside the server's namespace, launched by test_server.py."""

collect_ignore = ["inner"]
