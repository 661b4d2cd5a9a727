"""The SDK suites under `inner/`, `restart/`, `old_sdk/` (launched by test_server.py),
`network/` (by test_network.py) and `volumes/` (by test_volumes.py) run inside the server's
namespace."""

collect_ignore = ["inner", "restart", "old_sdk", "network", "volumes"]
