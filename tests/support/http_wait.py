"""Waiting for an HTTP endpoint to answer: a server starting (its first start builds the `base`
template), a web server started in a guest."""

from __future__ import annotations

import time

import httpx


def wait_until_up(url: str, timeout_s: float, interval_s: float = 0.5) -> bool:
    """Polls `GET url` until it answers 2xx (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).is_success:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
