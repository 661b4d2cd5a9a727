"""The HTTP control plane: E2B-compatible routes over the orchestrator."""
