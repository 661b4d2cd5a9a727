"""The SDK suites under `inner/`, `restart/` and `old_sdk/` run inside the server's namespace,
launched by test_server.py."""

collect_ignore = ["inner", "restart", "old_sdk"]
