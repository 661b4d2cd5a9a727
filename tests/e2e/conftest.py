"""The SDK suites under `inner/` and `restart/` run inside the server's namespace, launched by
test_server.py."""

collect_ignore = ["inner", "restart"]
