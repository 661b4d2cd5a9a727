"""Step timings of one operation, logged as one line: where a create, resume, save or fork
spends its time, read from the server's log (issue 18: every cut starts from such a line)."""

from __future__ import annotations

import time


class Steps:
    """Milliseconds per named step since the previous mark (or since creation)."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.parts: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        """The step `name` ends now."""
        now = time.perf_counter()
        self.parts.append((name, (now - self._last) * 1000))
        self._last = now

    def add(self, other: Steps, prefix: str = "") -> None:
        """`other`'s steps as steps of this one (an inner operation timed on its own); the
        time they took is not counted again by the next `mark`."""
        self.parts += [(prefix + name, ms) for name, ms in other.parts]
        self._last = max(self._last, other._last)

    def total_ms(self) -> float:
        return (self._last - self._start) * 1000

    def __str__(self) -> str:
        steps = ", ".join(f"{name} {ms:.0f}" for name, ms in self.parts)
        return f"{steps} (total {self.total_ms():.0f} ms)"
