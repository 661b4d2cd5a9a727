"""Data-plane proxy benchmarks: the same work through the proxy and directly, in the same run.

- `commands.run("true")` with the official e2b SDK: p50/p99 through the proxy vs straight to
  envd (runs interleaved, so drift hits both alike);
- `files.read` / `files.write` of a 256 MiB file: throughput through the proxy vs direct;
- small HTTP requests per second (16 keep-alive connections) to a web server in the "sandbox".

envd runs in the test suite's throwaway root; the proxy runs in its own process (as in the
server), on uvicorn with uvloop and httptools, with a fixed resolver. Prints one JSON document.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from e2b import Sandbox

from http_load import http_rate
from summary import percentile, summary_ms

from tests.support.envd_process import envd_in_throwaway_root
from tests.support.ports import free_port

RUNS = 300
FILE_MIB = 256
HTTP_REQUESTS = 20000
HTTP_CONCURRENCY = 16
SANDBOX_ID = "benchsandbox00000001"
ENVD_PORT = 49983
WEB_PORT = 8000
# The sandbox's port whose web server speaks HTTPS itself (`httpsPorts`).
HTTPS_WEB_PORT = 8443


def serve_proxy(
    port: int,
    envd_port: int,
    web_port: int,
    cert: str | None = None,
    key: str | None = None,
    https_web_port: int | None = None,
) -> None:
    """The proxy process: one sandbox whose envd and web server are on loopback; HTTPS to its
    clients with a certificate and key; a second web server over TLS as HTTPS_WEB_PORT."""

    from aenv.proxy import SandboxNotFound, SandboxProxy, Upstream

    ports = {ENVD_PORT: envd_port, WEB_PORT: web_port, HTTPS_WEB_PORT: https_web_port}

    class Resolver:
        async def resolve(self, sandbox_id: str, port: int) -> Upstream:
            if sandbox_id != SANDBOX_ID:
                raise SandboxNotFound(sandbox_id)
            local = ports.get(port) or port
            return Upstream("127.0.0.1", local, tls=port == HTTPS_WEB_PORT)

    _run(SandboxProxy(Resolver()), port, cert, key)


def serve_web(port: int, cert: str | None = None, key: str | None = None) -> None:
    """A minimal web server standing for a user's service in the sandbox (over TLS with a
    certificate and key)."""

    async def app(scope: dict[str, object], receive: object, send: Callable[..., object]) -> None:
        if scope["type"] != "http":
            return
        await send(  # type: ignore[misc]
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[misc]

    _run(app, port, cert, key)


def _run(app: object, port: int, cert: str | None, key: str | None) -> None:
    from tests.proxy.support import loopback_server

    loopback_server(app, port, (cert, key) if cert and key else None).run()


@contextmanager
def subprocess_server(args: list[str], port: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, __file__, *args])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server {args} did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


def sdk_sandbox(url: str, routed: bool) -> Sandbox:
    from e2b import ConnectionConfig, Sandbox
    from packaging.version import Version

    from aenv.envd import ENVD_VERSION

    headers = {"E2b-Sandbox-Id": SANDBOX_ID, "E2b-Sandbox-Port": str(ENVD_PORT)} if routed else {}
    config = ConnectionConfig(
        debug=False,
        api_url=url,
        sandbox_url=url,
        api_key="e2b_" + "0" * 40,
        extra_sandbox_headers=headers,
    )
    return Sandbox(
        sandbox_id=SANDBOX_ID,
        sandbox_domain=None,
        envd_version=Version(ENVD_VERSION),
        envd_access_token=None,
        traffic_access_token=None,
        connection_config=config,
    )


def bench_run(direct: Sandbox, proxied: Sandbox) -> dict[str, object]:
    samples: dict[str, list[float]] = {"direct": [], "proxy": []}
    for _ in range(RUNS):
        for name, sandbox in (("direct", direct), ("proxy", proxied)):
            start = time.perf_counter()
            sandbox.commands.run("true")
            samples[name].append(time.perf_counter() - start)
    d50, p50 = statistics.median(samples["direct"]), statistics.median(samples["proxy"])
    d99, p99 = percentile(samples["direct"], 99), percentile(samples["proxy"], 99)
    return {
        "runs": RUNS,
        "direct_ms": summary_ms(samples["direct"]),
        "proxy_ms": summary_ms(samples["proxy"]),
        "overhead_p50_ms": round((p50 - d50) * 1000, 3),
        "ratio_p50": round(p50 / d50, 3),
        "ratio_p99": round(p99 / d99, 3),
    }


def bench_files(direct: Sandbox, proxied: Sandbox) -> dict[str, object]:
    path = "/tmp/bench-proxy.bin"
    chunk = os.urandom(4 << 20)
    size = FILE_MIB << 20
    direct.files.write(path, iter([chunk] * (FILE_MIB // 4)))

    def read(sandbox: Sandbox) -> float:
        start = time.perf_counter()
        received = sum(len(c) for c in sandbox.files.read(path, format="stream"))
        assert received == size, (received, size)
        return time.perf_counter() - start

    def write(sandbox: Sandbox) -> float:
        start = time.perf_counter()
        sandbox.files.write(path, iter([chunk] * (FILE_MIB // 4)))
        return time.perf_counter() - start

    # Best of three each, alternating: the machine is shared and one slow pass is noise.
    reads: dict[str, list[float]] = {"direct": [], "proxy": []}
    writes: dict[str, list[float]] = {"direct": [], "proxy": []}
    for _ in range(3):
        for name, sandbox in (("direct", direct), ("proxy", proxied)):
            reads[name].append(read(sandbox))
            writes[name].append(write(sandbox))
    direct.files.remove(path)

    def mib_s(seconds: list[float]) -> float:
        return round(FILE_MIB / min(seconds), 1)

    return {
        "size_mib": FILE_MIB,
        "read_direct_mib_s": mib_s(reads["direct"]),
        "read_proxy_mib_s": mib_s(reads["proxy"]),
        "read_ratio": round(min(reads["direct"]) / min(reads["proxy"]), 3),
        "write_direct_mib_s": mib_s(writes["direct"]),
        "write_proxy_mib_s": mib_s(writes["proxy"]),
        "write_ratio": round(min(writes["direct"]) / min(writes["proxy"]), 3),
    }


def bench_http(web_port: int, proxy_port: int) -> dict[str, object]:
    headers = {"E2b-Sandbox-Id": SANDBOX_ID, "E2b-Sandbox-Port": str(WEB_PORT)}
    direct = asyncio.run(http_rate("127.0.0.1", web_port, {}, HTTP_REQUESTS, HTTP_CONCURRENCY))
    proxied = asyncio.run(
        http_rate("127.0.0.1", proxy_port, headers, HTTP_REQUESTS, HTTP_CONCURRENCY)
    )
    return {
        "requests": HTTP_REQUESTS,
        "concurrency": HTTP_CONCURRENCY,
        "direct_rps": round(direct),
        "proxy_rps": round(proxied),
        "ratio": round(direct / proxied, 3),
    }


def main() -> None:
    envd_port, web_port, proxy_port = free_port(), free_port(), free_port()
    with (
        envd_in_throwaway_root(envd_port) as envd_url,
        subprocess_server(["--web", str(web_port)], web_port),
        subprocess_server(
            ["--proxy", str(proxy_port), str(envd_port), str(web_port)], proxy_port
        ) as proxy_url,
    ):
        direct = sdk_sandbox(envd_url, routed=False)
        proxied = sdk_sandbox(proxy_url, routed=True)
        for sandbox in (direct, proxied):
            sandbox.commands.run("true")
        result = {
            "benchmark": "proxy",
            "date": time.strftime("%Y-%m-%d"),
            "commands_run_true": bench_run(direct, proxied),
            "files_256mib": bench_files(direct, proxied),
            "http_small_requests": bench_http(web_port, proxy_port),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    # --proxy PORT ENVD_PORT WEB_PORT [CERT KEY [HTTPS_WEB_PORT]] | --web PORT [CERT KEY]
    if sys.argv[1:2] == ["--proxy"]:
        port, envd_port, web_port = (int(a) for a in sys.argv[2:5])
        cert, key = (sys.argv[5:7] + [""] * 2)[:2]
        https_web = int(sys.argv[7]) if len(sys.argv) > 7 else None
        serve_proxy(port, envd_port, web_port, cert or None, key or None, https_web)
    elif sys.argv[1:2] == ["--web"]:
        serve_web(int(sys.argv[2]), *sys.argv[3:5])
    else:
        main()
