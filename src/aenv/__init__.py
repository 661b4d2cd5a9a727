"""AENV-py: self-hosted, E2B-compatible microVM sandboxes for AI agents."""

__version__ = "0.1.0"
