"""The node's API key: generated on first start, stored 0600, compared in constant time."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from aenv.ids import new_api_key


def ensure_api_key(path: Path) -> tuple[str, bool]:
    """The stored key, creating it if missing. Returns (key, created)."""
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if key:
        return key, False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = new_api_key()
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    tmp.replace(path)
    return key, True


def key_matches(expected: str, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(expected.encode(), given.strip().encode())
