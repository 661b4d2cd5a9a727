"""Per-key request rate limits: a token bucket per API key.

Each key may make `rate` requests a second on average and `burst` at once; past that a request
is answered 429 (as E2B does; its SDKs raise `RateLimitException`) with `Retry-After` saying
when the next one will be accepted. Buckets exist per key the store holds, so their number is
bounded by the keys, not by clients.

A request that may wait (a create sent with `X-Aenv-Wait`: `wait_of`) takes the
next token instead, up to `max_wait` seconds ahead, and is held until then: a burst of such
creates is spread at the key's rate rather than partly refused, which is the client-side
jitter the wait exists to spare. The bucket goes below zero by the tokens so promised, so the
requests after them, waiting or not, are counted behind them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from starlette.requests import Request

from aenv.api.errors import APIError
from aenv.api.extensions import WAIT_HEADER


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    def __init__(self, rate: float, burst: int, max_wait: float = 0.0) -> None:
        self.rate = rate
        self.burst = burst
        self.max_wait = max_wait
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key_id: str, wait: float = 0.0) -> float | None:
        """Spend one request of `key_id`, which may be held up to `wait` seconds (cut to
        `max_wait`): the seconds to hold it (0: go now), or None when it is refused (nothing
        spent: `retry_in` says when one would be accepted)."""
        bucket = self._refilled(key_id)
        ahead = max(0.0, (1 - bucket.tokens) / self.rate)
        if ahead > min(wait, self.max_wait):
            return None
        bucket.tokens -= 1
        return ahead

    def retry_in(self, key_id: str) -> float:
        """Seconds until a request of `key_id` that does not wait would be accepted."""
        return max(0.0, (1 - self._refilled(key_id).tokens) / self.rate)

    def _refilled(self, key_id: str) -> _Bucket:
        now = time.monotonic()
        bucket = self._buckets.setdefault(key_id, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        return bucket

    def forget(self, key_id: str) -> None:
        self._buckets.pop(key_id, None)


def retry_after(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def wait_of(request: Request) -> float:
    """The seconds the request may wait for capacity: 0 without the header; 400 when it is not
    a number of seconds (it is cut to the node's `create_max_wait` later)."""
    raw = request.headers.get(WAIT_HEADER)
    if raw is None:
        return 0.0
    wait = seconds_of(raw)
    if wait is None:
        raise APIError(400, f"header {WAIT_HEADER}: seconds to wait for capacity, a number >= 0")
    return wait


def seconds_of(raw: str) -> float | None:
    """The `X-Aenv-Wait` header's seconds; None when it is not a number of seconds >= 0."""
    try:
        wait = float(raw)
    except ValueError:
        return None
    return wait if math.isfinite(wait) and wait >= 0 else None
