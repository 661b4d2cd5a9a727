"""HTTPS overhead of the data plane: the same route through the proxy over plain HTTP and over
HTTPS (`aenv server --tls-cert/--tls-key`), and to a sandbox port whose service speaks HTTPS
itself (`httpsPorts`: plain to the proxy, TLS from the proxy to the sandbox), in the same run.

- small requests per second over 16 keep-alive connections (bench/proxy.py's client, with TLS);
- a new connection per request (TCP, plus the TLS handshake on the HTTPS side), median and p99;

The proxy runs in its own process on uvicorn, as in the server, in front of a minimal web
server; the certificate comes from a CA made by this script (trustme). Prints one JSON
document.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trustme
from proxy import HTTPS_WEB_PORT, SANDBOX_ID, WEB_PORT, subprocess_server
from summary import summary_ms

from tests.support.ports import free_port

REQUESTS = 10000
CONCURRENCY = 16
CONNECTIONS = 500


def _request(port: int) -> bytes:
    return (
        f"GET / HTTP/1.1\r\nHost: localhost\r\nE2b-Sandbox-Id: {SANDBOX_ID}\r\n"
        f"E2b-Sandbox-Port: {port}\r\n\r\n"
    ).encode()


REQUEST = _request(WEB_PORT)


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes = REQUEST
) -> None:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    await reader.readexactly(2)  # the web server's "ok"


async def keepalive_rate(port: int, tls: ssl.SSLContext | None, request: bytes = REQUEST) -> float:
    remaining = REQUESTS

    async def worker() -> None:
        nonlocal remaining
        host = "localhost" if tls else None
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls, server_hostname=host
        )
        try:
            while remaining > 0:
                remaining -= 1
                await _exchange(reader, writer, request)
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return REQUESTS / (time.perf_counter() - start)


async def new_connections(
    port: int, tls: ssl.SSLContext | None, request: bytes = REQUEST
) -> list[float]:
    samples = []
    for _ in range(CONNECTIONS):
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls, server_hostname="localhost" if tls else None
        )
        await _exchange(reader, writer, request)
        samples.append(time.perf_counter() - start)
        writer.close()
    return samples


def main() -> None:
    ca = trustme.CA()
    client = ssl.create_default_context()
    ca.configure_trust(client)
    envd_port, web_port, plain_port, tls_port, web_tls_port = (free_port() for _ in range(5))
    with tempfile.TemporaryDirectory() as files:
        cert, key = Path(files, "cert.pem"), Path(files, "key.pem")
        issued = ca.issue_cert("localhost")
        issued.cert_chain_pems[0].write_to_path(str(cert))
        issued.private_key_pem.write_to_path(str(key))
        plain_args = ["--proxy", str(plain_port), str(envd_port), str(web_port), "", ""]
        plain_args.append(str(web_tls_port))
        tls_args = ["--proxy", str(tls_port), str(envd_port), str(web_port), str(cert), str(key)]
        https_port = _request(HTTPS_WEB_PORT)
        with (
            subprocess_server(["--web", str(web_port)], web_port),
            subprocess_server(["--web", str(web_tls_port), str(cert), str(key)], web_tls_port),
            subprocess_server(plain_args, plain_port),
            subprocess_server(tls_args, tls_port),
        ):
            asyncio.run(keepalive_rate(plain_port, None))  # warm-up
            asyncio.run(keepalive_rate(tls_port, client))
            plain_rps = asyncio.run(keepalive_rate(plain_port, None))
            tls_rps = asyncio.run(keepalive_rate(tls_port, client))
            asyncio.run(keepalive_rate(plain_port, None, https_port))
            to_https_port_rps = asyncio.run(keepalive_rate(plain_port, None, https_port))
            plain_new = asyncio.run(new_connections(plain_port, None))
            tls_new = asyncio.run(new_connections(tls_port, client))
            to_https_port_new = asyncio.run(new_connections(plain_port, None, https_port))
    result = {
        "benchmark": "tls",
        "date": time.strftime("%Y-%m-%d"),
        "keepalive_requests": REQUESTS,
        "plain_rps": round(plain_rps),
        "https_rps": round(tls_rps),
        "https_over_plain": round(tls_rps / plain_rps, 3),
        "new_connection_plain_ms": summary_ms(plain_new),
        "new_connection_https_ms": summary_ms(tls_new),
        "https_port_rps": round(to_https_port_rps),
        "https_port_over_plain": round(to_https_port_rps / plain_rps, 3),
        "new_connection_https_port_ms": summary_ms(to_https_port_new),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
