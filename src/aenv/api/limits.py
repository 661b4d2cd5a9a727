"""Per-key request rate limits: a token bucket per API key.

Each key may make `rate` requests a second on average and `burst` at once; past that a request
is answered 429 (as E2B does; its SDKs raise `RateLimitException`) with `Retry-After` saying
when the next one will be accepted. Buckets exist per key the store holds, so their number is
bounded by the keys, not by clients.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key_id: str) -> float | None:
        """Spend one request of `key_id`: None when allowed, else the seconds until it would
        be."""
        now = time.monotonic()
        bucket = self._buckets.setdefault(key_id, _Bucket(float(self.burst), now))
        bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
        bucket.at = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return None
        return (1 - bucket.tokens) / self.rate

    def forget(self, key_id: str) -> None:
        self._buckets.pop(key_id, None)


def retry_after(seconds: float) -> str:
    """A `Retry-After` value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
