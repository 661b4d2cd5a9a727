"""Small HTTP GETs as fast as keep-alive connections allow: a bare asyncio client, because
httpx tops out near 1,000 requests/s here and would measure itself."""

from __future__ import annotations

import asyncio
import time


async def http_rate(
    host: str, port: int, headers: dict[str, str], requests: int, concurrency: int
) -> float:
    """Requests per second for `requests` GETs of / over `concurrency` connections, after a
    warm-up of a tenth as many. Every answer must be a 200 with a Content-Length."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = f"GET / HTTP/1.1\r\nHost: {host}:{port}\r\n{extra}\r\n".encode()
    remaining = 0

    async def worker() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while remaining > 0:
                remaining -= 1
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200"), head
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
        finally:
            writer.close()

    remaining = requests // 10
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    remaining = requests
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return requests / (time.perf_counter() - start)
