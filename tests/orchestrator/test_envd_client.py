"""`EnvdClient`'s file calls (what template builds write, read and COPY in their VM) against a
double sandbox's envd on loopback, which checks the token as envd does: the token goes with
every call, and envd's refusals come back as `EnvdRefused` with envd's own reason."""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pyqwest
import pytest
import trustme

from aenv.cluster.secret import ClusterSecret
from aenv.gateway.nodes import NodeClient
from aenv.orchestrator.envd_client import EnvdRefused, http_client, rpc_transport
from tests.doubles.node import double_node


async def test_files_and_copy_go_with_the_sandboxs_token(tmp_path: Path) -> None:
    upload = tmp_path / "upload.tar.gz"
    upload.write_bytes(b"archive bytes")
    async with double_node(tmp_path / "home") as node:
        record, _ = await node.orchestrator.create(node.request())
        envd = node.orchestrator.envd(record.id)
        await envd.write_file("/tmp/small", b"small")
        await envd.write_file("/tmp/upload.tar.gz", upload)
        assert await envd.read_file("/tmp/small", "user") == b"small"
        assert await envd.read_file("/tmp/upload.tar.gz", "user") == b"archive bytes"
        placed = await envd.copy("/tmp/upload.tar.gz", "app", "/srv/app", "user", "755")
        assert placed == ["/srv/app"]
        assert node.guest(record.id).copies == [
            {"archive": "/tmp/upload.tar.gz", "src": "app", "dest": "/srv/app",
             "owner": "user", "mode": "755"},
        ]  # fmt: skip


async def test_envds_refusals_carry_its_reason(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node:
        record, _ = await node.orchestrator.create(node.request())
        envd = node.orchestrator.envd(record.id)
        with pytest.raises(EnvdRefused) as refused:
            await envd.copy("/tmp/absent.tar.gz", "app", "/srv/app", "user", None)
        assert (refused.value.status, refused.value.reason) == (400, "no such archive")
        with pytest.raises(EnvdRefused) as missing:
            await envd.read_file("/nowhere", "user")
        assert (missing.value.status, missing.value.reason) == (404, "no such file")
        tokenless = dataclasses.replace(envd, token=None)
        calls: list[Callable[[], Awaitable[object]]] = [
            lambda: tokenless.read_file("/etc/hostname", "user"),
            lambda: tokenless.write_file("/tmp/x", b"x"),
            lambda: tokenless.copy("/tmp/x", "x", "/x", "user", None),
        ]
        for call in calls:
            with pytest.raises(EnvdRefused) as unauthorized:
                await call()
            assert unauthorized.value.status == 401
        assert node.guest(record.id).read("/tmp/x") is None
        assert node.guest(record.id).copies == []


async def test_the_envd_http_client_trusts_no_tls_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It loads no CA store, so it must not pass for a client of TLS servers: it trusts no
    certificate, not even one of a CA the host's settings (`SSL_CERT_FILE`) name, which a
    client that loads the store does trust. The node's client is one."""
    ca = trustme.CA()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(tls)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    try:
        async with httpx.AsyncClient() as trusting:
            assert (await trusting.get(url)).status_code == 204
        async with http_client() as http, double_node(tmp_path / "node") as node:
            for client in (http, node.orchestrator.node.client):
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await client.get(url)
    finally:
        server.close()
        await server.wait_closed()


async def test_guests_are_reached_past_the_hosts_proxy_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With HTTP_PROXY and ALL_PROXY naming a proxy on loopback, the node's envd clients (HTTP
    and Connect RPC) and a gateway's client of its nodes still go straight to the server: a
    proxy would see every sandbox's token and the cluster secret."""
    proxied: list[bytes] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        proxied.append(await reader.read(100))
        writer.close()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await writer.drain()
        writer.close()

    proxy_server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, f"http://127.0.0.1:{proxy_server.sockets[0].getsockname()[1]}")
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
    try:
        async with http_client() as http:
            assert (await http.get(url)).status_code == 204
        assert (await pyqwest.Client(rpc_transport()).get(url)).status == 204
        gateway = NodeClient(ClusterSecret("s" * 32))
        try:
            assert (await gateway._http.get(url)).status_code == 204
        finally:
            await gateway.aclose()
        assert proxied == []
    finally:
        for s in (server, proxy_server):
            s.close()
            await s.wait_closed()
