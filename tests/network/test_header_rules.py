"""Header rules (E2B's `network.rules`) with real traffic: a fake guest's curl, Python and Node
clients reach an HTTPS server in the simulated internet that echoes the headers it gets. Names
with rules are intercepted with the node's egress CA and get their headers; other names pass
through untouched, and a rule's header reaches no other name, also not after a redirect, nor a
server that does not verify for the name."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import h2.config
import h2.connection
import h2.errors
import h2.events
import h11
import jwt
import pytest
import trustme

from aenv.ids import TEAM_ID
from aenv.network import EgressPolicy, Slot, SlotPool
from aenv.network.egress_ca import CA_CERT, CA_KEY, EgressCA
from aenv.network.header_rules import (
    HeaderRule,
    HeaderRules,
    SecretUnavailable,
    apply,
    resolve,
)
from aenv.network.identity import IdentityTokens, Subject, WorkloadIdentity
from aenv.network.identity_signer import IdentitySigner, key_from_seed
from aenv.network.interception import PlainStream, exchange
from aenv.network.interception_h2 import Bridge
from aenv.network.sniff import tls_alpn
from aenv.orchestrator.catalog import Catalog
from aenv.orchestrator.secrets import SecretStore, load_key
from tests.network import probes
from tests.network.conftest import INET_IP, INET_OTHER_IP, World
from tests.network.fakeguest import FakeGuest

MakePool = Callable[..., Awaitable[SlotPool]]
Boot = Callable[[Slot], Awaitable[FakeGuest]]

SECRET = ("X-Api-Key", "s3cret")
BIG = 5 * 1024 * 1024 + 3
RULES = HeaderRules(
    (
        HeaderRule("ruled.test", (SECRET, ("Authorization", "Bearer node"))),
        HeaderRule("*.wild.test", (("X-Wild", "1"),)),
    )
)
POLICY = EgressPolicy.parse(
    allow=["ruled.test", "other.test", "*.wild.test", "unruled.test"],
    deny=["0.0.0.0/0"],
    headers=RULES,
)


async def _echo(
    seen: list[str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """HTTP/1.1 with keep-alive, recording the targets asked for in `seen`: `/big` is BIG zero
    bytes, `/redirect` sends
    the client to other.test, an `Upgrade` request switches to echoing bytes, anything else is
    answered with the request's headers and body length as JSON."""
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                continue
            if not isinstance(event, h11.Request):
                break
            headers = [(n.decode(), v.decode()) for n, v in event.headers.raw_items()]
            target = event.target
            seen.append(target.decode())
            size = 0
            while not isinstance(event := conn.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Data):
                    size += len(event.data)
            if any(n.lower() == "upgrade" for n, _ in headers):
                upgrade = [(b"Upgrade", b"echo"), (b"Connection", b"Upgrade")]
                writer.write(conn.send(h11.InformationalResponse(status_code=101, headers=upgrade)))
                writer.write(json.dumps(headers).encode() + b"\n")
                while data := await reader.read(65536):
                    writer.write(data)
                break
            if target == b"/big":  # zeros, more than a stream's HTTP/2 window
                body = bytes(BIG)
                response = h11.Response(
                    status_code=200, headers=[("Content-Length", str(len(body)))]
                )
            elif target == b"/redirect":
                body = b""
                response = h11.Response(
                    status_code=302,
                    headers=[("Location", "https://other.test/"), ("Content-Length", "0")],
                )
            else:
                body = json.dumps({"headers": headers, "size": size}).encode()
                response = h11.Response(
                    status_code=200,
                    headers=[
                        ("Content-Type", "application/json"),
                        ("Content-Length", str(len(body))),
                    ],
                )
            writer.write(conn.send(response) + conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                break
            conn.start_next_cycle()
    except (h11.ProtocolError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture(scope="module")
def origin_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def impostor_saw() -> list[str]:
    return []


@pytest.fixture
async def web(
    world: World, origin_ca: trustme.CA, tmp_path: Path, impostor_saw: list[str]
) -> AsyncIterator[Path]:
    """The internet's HTTPS server on INET_IP:443, with a certificate of `origin_ca` (which
    the node trusts), and on INET_OTHER_IP:443 an impostor with a certificate for the same
    names from a CA nobody trusts. Yields the file of `origin_ca`."""
    names = ("ruled.test", "other.test", "*.wild.test", "unruled.test")
    servers = []
    for address, ca, seen in (
        (INET_IP, origin_ca, []),
        (INET_OTHER_IP, trustme.CA(), impostor_saw),
    ):
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert(*names).configure_cert(context)
        sock = await probes.ns_socket(world.inet)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, 443))
        servers.append(await asyncio.start_server(partial(_echo, seen), sock=sock, ssl=context))
    pem = tmp_path / "origin.pem"
    origin_ca.cert_pem.write_to_path(str(pem))
    yield pem
    for server in servers:
        server.close()


@pytest.fixture
async def guest(
    make_pool: MakePool, boot: Boot, web: Path, tmp_path: Path
) -> AsyncIterator[FakeGuest]:
    """A fake guest with POLICY, whose names are all at INET_IP."""
    pool = await make_pool(egress_ca=tmp_path / "ca", upstream_ca=web)
    async with _named(await boot(await pool.acquire(policy=POLICY))) as guest:
        yield guest


@contextlib.asynccontextmanager
async def _named(guest: FakeGuest) -> AsyncIterator[FakeGuest]:
    """`guest` resolving the test's names to INET_IP (`ip netns exec` mounts
    /etc/netns/<name>/hosts over /etc/hosts for the commands it runs)."""
    etc = Path("/etc/netns", guest.netns)
    etc.mkdir(parents=True)
    try:
        names = " ".join(("ruled.test", "other.test", "a.wild.test", "unruled.test", "grpc.test"))
        (etc / "hosts").write_text(f"{INET_IP} {names}\n")
        yield guest
    finally:
        shutil.rmtree(etc)


def _bundle(tmp_path: Path, origin: Path) -> Path:
    """What a guest with rules trusts: the internet's CAs and the node's egress CA."""
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(origin.read_bytes() + (tmp_path / "ca" / CA_CERT).read_bytes())
    return bundle


async def _run(
    guest: FakeGuest, *command: str, env: dict[str, str] | None = None
) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        "ip",
        "netns",
        "exec",
        guest.netns,
        *command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def _curl(guest: FakeGuest, *args: str) -> tuple[int, str]:
    return await _run(guest, "curl", "-sS", "--max-time", "20", *args)


def _got(output: str) -> dict[str, list[str]]:
    """Every header of every echo in `output` (curl's progress meter may share its lines)."""
    headers: dict[str, list[str]] = {}
    for echo in re.findall(r'\{"headers": ?.*?, ?"size": ?\d+\}', output):
        for name, value in json.loads(echo)["headers"]:
            headers.setdefault(name.lower(), []).append(value)
    return headers


async def test_rules_set_headers_only_on_their_names(
    guest: FakeGuest, web: Path, tmp_path: Path
) -> None:
    bundle = _bundle(tmp_path, web)
    code, out = await _curl(
        guest,
        "--cacert",
        str(bundle),
        "-H",
        "Authorization: guest",
        "-w",
        "\\n",
        "https://ruled.test/",
        "https://ruled.test/again",  # the same connection, kept alive
        "https://a.wild.test/",
        "https://other.test/",
    )
    assert code == 0, out
    bodies = [line for line in out.splitlines() if line.startswith("{")]
    assert len(bodies) == 4, out
    ruled, again, wild, other = (_got(body) for body in bodies)
    for got in (ruled, again):
        assert got["x-api-key"] == ["s3cret"]
        assert got["authorization"] == ["Bearer node"]  # replaced, not added
    assert wild["x-wild"] == ["1"] and "x-api-key" not in wild
    assert other["authorization"] == ["guest"] and "x-api-key" not in other

    # A ruled name shows the node's certificate, any other name the server's own.
    node_only = tmp_path / "ca" / CA_CERT
    assert (await _curl(guest, "--cacert", str(node_only), "https://ruled.test/"))[0] == 0
    assert (await _curl(guest, "--cacert", str(node_only), "https://other.test/"))[0] != 0


async def test_http2_clients_bodies_and_redirects(
    guest: FakeGuest, web: Path, tmp_path: Path
) -> None:
    """HTTP/2 from the guest: streams become HTTP/1.1 requests with the rule's headers, bodies
    both ways larger than the windows, streams in parallel on one connection."""
    bundle = _bundle(tmp_path, web)
    upload = tmp_path / "upload"
    upload.write_bytes(b"x" * (3 * 1024 * 1024 + 7))
    code, out = await _curl(
        guest,
        "--cacert",
        str(bundle),
        "--http2",
        "-w",
        "\\n%{http_version}\\n",
        "--data-binary",
        f"@{upload}",
        "https://ruled.test/",
    )
    assert code == 0, out
    body = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert body["size"] == 3 * 1024 * 1024 + 7
    assert out.split()[-1] == "2"
    assert _got(out)["x-api-key"] == ["s3cret"]
    # Several streams at once on one connection (each its own request to the server), and
    # a download larger than a stream's window.
    urls = [f"https://ruled.test/{i}" for i in range(6)]
    parallel = ("--http2", "--parallel", "--parallel-immediate", "-w", "\\n%{http_version}\\n")
    code, out = await _curl(guest, "--cacert", str(bundle), *parallel, *urls)
    assert code == 0, out
    assert [line for line in out.splitlines() if line in ("1.1", "2")] == ["2"] * 6
    assert _got(out)["x-api-key"] == ["s3cret"] * 6, out
    code, out = await _curl(
        guest, "--cacert", str(bundle), "--http2", "-o", "/dev/null", "-w", "%{size_download}",
        "https://ruled.test/big",
    )  # fmt: skip
    assert (code, out) == (0, str(BIG))
    # HTTP/1.1 clients are served as before.
    code, out = await _curl(guest, "--cacert", str(bundle), "--http1.1", "https://ruled.test/")
    assert code == 0 and _got(out)["x-api-key"] == ["s3cret"]
    # Redirected elsewhere, the client's next request goes without the rule's headers.
    code, out = await _curl(guest, "--cacert", str(bundle), "-L", "https://ruled.test/redirect")
    assert code == 0, out
    assert "x-api-key" not in _got(out) and "authorization" not in _got(out)


async def test_no_header_to_an_unverified_server_or_over_plain_http(
    guest: FakeGuest, web: Path, tmp_path: Path, impostor_saw: list[str]
) -> None:
    bundle = _bundle(tmp_path, web)
    # The guest dials the impostor with the ruled name: the proxy does not verify it, so the
    # guest's connection fails and the impostor never sees a request.
    impostor = ("--resolve", f"ruled.test:443:{INET_OTHER_IP}")
    code, out = await _curl(guest, "--cacert", str(bundle), *impostor, "https://ruled.test/")
    assert code != 0 and "s3cret" not in out
    assert impostor_saw == []
    # Without a rule, the same guest reaches the impostor as it asked (nothing intercepted).
    elsewhere = ("--resolve", f"unruled.test:443:{INET_OTHER_IP}", "-k")
    assert (await _curl(guest, *elsewhere, "https://unruled.test/x"))[0] == 0
    assert impostor_saw == ["/x"]
    # Plain HTTP to a ruled name is refused rather than sent without (or with) its headers.
    code, out = await _curl(guest, "http://ruled.test:443/")
    assert code != 0


_PYTHON = """
import json, requests
with requests.Session() as s:
    for url in ("https://ruled.test/", "https://unruled.test/"):
        print(json.dumps(s.get(url, headers={"X-Api-Key": "guest"}).json()))
"""
_NODE = """
for (const url of ["https://ruled.test/", "https://unruled.test/"]) {
  const r = await fetch(url, {headers: {"X-Api-Key": "guest"}});
  console.log(JSON.stringify(await r.json()));
}
"""


async def test_python_requests_and_node_fetch(guest: FakeGuest, web: Path, tmp_path: Path) -> None:
    """The variables a guest with rules gets name the bundle with the node's CA."""
    bundle = _bundle(tmp_path, web)
    env = {"PATH": "/usr/bin:/bin", "REQUESTS_CA_BUNDLE": str(bundle)}
    code, out = await _run(guest, sys.executable, "-c", _PYTHON, env=env)
    assert code == 0, out
    ruled, unruled = (_got(line) for line in out.splitlines() if line.startswith("{"))
    assert ruled["x-api-key"] == ["s3cret"] and unruled["x-api-key"] == ["guest"]
    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    node_env = {
        "PATH": "/usr/bin:/bin",
        "NODE_EXTRA_CA_CERTS": str(bundle),
    }
    code, out = await _run(guest, "node", "--input-type=module", "-e", _NODE, env=node_env)
    assert code == 0, out
    ruled, unruled = (_got(line) for line in out.splitlines() if line.startswith("{"))
    assert ruled["x-api-key"] == ["s3cret"] and unruled["x-api-key"] == ["guest"]


async def test_upgrade_switches_to_bytes_with_headers_set(
    guest: FakeGuest, web: Path, tmp_path: Path
) -> None:
    """A WebSocket-style upgrade: the request gets the rule's headers, then bytes flow."""
    context = ssl.create_default_context(cafile=str(_bundle(tmp_path, web)))
    sock = await probes.ns_socket(guest.netns)
    await asyncio.get_running_loop().sock_connect(sock, (INET_IP, 443))
    reader, writer = await asyncio.open_connection(
        sock=sock, ssl=context, server_hostname="ruled.test"
    )
    try:
        writer.write(
            b"GET /ws HTTP/1.1\r\nHost: ruled.test\r\nUpgrade: echo\r\nConnection: Upgrade\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101")
        seen = dict((n.lower(), v) for n, v in json.loads(await reader.readline()))
        assert seen["x-api-key"] == "s3cret"
        writer.write(b"ping\n")
        assert await asyncio.wait_for(reader.readline(), 10) == b"ping\n"
    finally:
        writer.close()


FILLED = "${e2b.secrets.API-KEY}"  # as `Secret.fill("API-KEY")` makes it
SECRET_RULES = HeaderRules(
    (
        HeaderRule("ruled.test", (("X-Api-Key", FILLED), ("Authorization", "Bearer " + FILLED))),
        HeaderRule("*.wild.test", (("X-Api-Key", "${e2b.secrets.missing}"),)),
    )
)


@pytest.fixture
async def secrets(tmp_path: Path) -> AsyncIterator[SecretStore]:
    """The node's secret store over a real catalog, holding `api-key` = v1-s3cret."""
    catalog = Catalog(tmp_path / "catalog.db")
    store = SecretStore(catalog, load_key(tmp_path / "secrets.key", create=True))
    store.create(TEAM_ID, "api-key", "v1-s3cret", {})
    yield store
    catalog.close()


async def test_secrets_are_filled_in_at_egress(
    make_pool: MakePool, boot: Boot, web: Path, tmp_path: Path, secrets: SecretStore
) -> None:
    """A rule's header naming a secret reaches the server with the secret's value as it is
    when each request is sent; the guest's own request holds no value, a name without the
    rule gets none, and a rule naming a secret that does not exist sends nothing."""
    pool = await make_pool(egress_ca=tmp_path / "ca", upstream_ca=web, secrets=secrets)
    policy = EgressPolicy.parse(
        allow=["ruled.test", "other.test", "*.wild.test"], deny=["0.0.0.0/0"], headers=SECRET_RULES
    )
    async with _named(await boot(await pool.acquire(policy=policy))) as guest:
        bundle = ("--cacert", str(_bundle(tmp_path, web)))
        code, out = await _curl(
            guest, *bundle, "--http1.1", "-v", "-H", "X-Api-Key: guest", "https://ruled.test/"
        )
        assert code == 0, out
        got = _got(out)
        assert got["x-api-key"] == ["v1-s3cret"]
        assert got["authorization"] == ["Bearer v1-s3cret"]
        sent = [line.lower() for line in out.splitlines() if line.startswith("> ")]
        assert "> x-api-key: guest" in sent and not any("s3cret" in line for line in sent)

        # An update counts from the next request on; HTTP/2 streams are filled in alike.
        secrets.update(TEAM_ID, "API-KEY", "v2-s3cret", None)
        code, out = await _curl(guest, *bundle, "--http2", "https://ruled.test/")
        assert code == 0 and _got(out)["x-api-key"] == ["v2-s3cret"], out
        # Redirected to a name without the rule: no secret goes along.
        code, out = await _curl(guest, *bundle, "-L", "https://ruled.test/redirect")
        assert code == 0 and "s3cret" not in out, out

        # A secret that does not exist: the request is not sent, over either protocol.
        for protocol in ("--http1.1", "--http2"):
            code, out = await _curl(guest, *bundle, protocol, "https://a.wild.test/")
            assert code != 0 and '"headers"' not in out, out
        # Another team's sandbox with the same rules reads its own team's secrets: none.
        await pool.set_policy(guest.slot, dataclasses.replace(policy, team_id="beta"))
        code, out = await _curl(guest, *bundle, "https://ruled.test/")
        assert code != 0 and '"headers"' not in out, out
        await pool.set_policy(guest.slot, policy)
        secrets.delete(TEAM_ID, "api-key")
        code, out = await _curl(guest, *bundle, "https://ruled.test/")
        assert code != 0 and '"headers"' not in out, out


async def test_workload_tokens_are_filled_in_at_egress(
    make_pool: MakePool, boot: Boot, web: Path, tmp_path: Path
) -> None:
    """A rule naming one of the sandbox's workload tokens sends a JWT-SVID minted for it, which
    verifies against the signer's JWKS for that audience alone; a rule naming a token the
    sandbox does not define sends nothing."""
    signer = IdentitySigner(key_from_seed(b"test"), "https://issuer.test")
    pool = await make_pool(egress_ca=tmp_path / "ca", upstream_ca=web, signer=signer)
    rules = HeaderRules(
        (
            HeaderRule("ruled.test", (("Authorization", "Bearer ${e2b.identity.tokens.aws}"),)),
            HeaderRule("*.wild.test", (("X-Token", "${e2b.identity.tokens.gcp}"),)),
        )
    )
    subject = Subject("sbx0123456789abcdefgh", TEAM_ID, "base")
    identity = WorkloadIdentity(subject, IdentityTokens((("aws", "sts.test"),)))
    policy = EgressPolicy.parse(
        allow=["ruled.test", "*.wild.test"], deny=["0.0.0.0/0"], headers=rules
    )
    policy = dataclasses.replace(policy, identity=identity)
    key = jwt.PyJWK(signer.jwks()["keys"][0])
    async with _named(await boot(await pool.acquire(policy=policy))) as guest:
        bundle = ("--cacert", str(_bundle(tmp_path, web)))
        tokens = []
        for protocol in ("--http1.1", "--http2"):
            code, out = await _curl(guest, *bundle, protocol, "https://ruled.test/")
            assert code == 0, out
            [sent] = _got(out)["authorization"]
            tokens.append(sent.removeprefix("Bearer "))
        for token in tokens:
            claims = jwt.decode(token, key, algorithms=["ES256"], audience="sts.test")
            assert claims["sandbox_id"] == subject.sandbox_id and claims["template_id"] == "base"
            with pytest.raises(jwt.InvalidAudienceError):
                jwt.decode(token, key, algorithms=["ES256"], audience="other.test")
        code, out = await _curl(guest, *bundle, "https://a.wild.test/")
        assert code != 0 and '"headers"' not in out, out


def test_resolving_names_secrets_never_values() -> None:
    class Values:
        def value(self, name: str, team_id: str) -> str | None:
            if team_id != "alpha":
                return None
            return {"a": "one", "b": "two", "bad": "line\r\nX-Injected: 1"}.get(name)

    headers = (("X-A", "${e2b.secrets.a}:${e2b.secrets.b}"), ("X-Plain", "as is"))
    assert resolve(headers, Values(), team_id="alpha") == (("X-A", "one:two"), ("X-Plain", "as is"))
    with pytest.raises(SecretUnavailable, match="'a' does not exist"):
        resolve(headers, Values(), team_id="beta")  # another team's secrets are not its
    with pytest.raises(SecretUnavailable, match="'c' does not exist"):
        resolve((("X-A", "${e2b.secrets.c}"),), Values(), team_id="alpha")
    with pytest.raises(SecretUnavailable, match="'a' does not exist"):
        # A node without a store sends nothing.
        resolve((("X-A", "${e2b.secrets.a}"),), None, team_id="alpha")
    with pytest.raises(SecretUnavailable, match="not a header value") as refused:
        resolve((("X-A", "${e2b.secrets.bad}"),), Values(), team_id="alpha")
    assert "Injected" not in str(refused.value)


def test_the_ca_key_is_private(tmp_path: Path) -> None:
    ca = EgressCA(tmp_path / "ca")
    assert (tmp_path / "ca" / CA_KEY).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "ca").stat().st_mode & 0o777 == 0o700
    assert b"PRIVATE" not in ca.cert_pem
    # The same CA on the next start; leaves are made per name and kept.
    assert EgressCA(tmp_path / "ca").cert_pem == ca.cert_pem
    assert ca.server_context("a.test") is ca.server_context("a.test")
    assert sorted(p.name for p in (tmp_path / "ca").iterdir()) == [CA_KEY, CA_CERT]


def test_rule_order_and_refused_headers() -> None:
    rules = HeaderRules(
        (
            HeaderRule("API.example.com.", (("X-A", "exact"), ("X-B", "b"))),
            HeaderRule("*.example.com", (("X-A", "wild"), ("X-C", "c"))),
        )
    )
    assert rules.domains == ("api.example.com", "*.example.com")
    # The wildcard first, so the exact name's value is the one left standing.
    got = apply([(b"x-a", b"guest"), (b"Accept", b"*/*")], rules.headers_for("Api.Example.com"))
    assert got == [(b"Accept", b"*/*"), (b"X-C", b"c"), (b"X-A", b"exact"), (b"X-B", b"b")]
    assert rules.headers_for("example.com") == ()
    for name, value in (
        ("Content-Length", "1"),
        ("host", "a.test"),
        ("Transfer-Encoding", "chunked"),
        ("Bad Name", "x"),
        ("X-A", "line\r\nX-Injected: 1"),
        ("X-A", " padded"),
        ("X-A", "é€"),
    ):
        with pytest.raises(ValueError):
            HeaderRule("a.test", ((name, value),))
    with pytest.raises(ValueError):
        HeaderRule("1.2.3.4", (("X-A", "1"),))


class _Http10(BaseHTTPRequestHandler):
    """Python's own server: HTTP/1.0 responses, the body until the connection closes."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(list(self.headers.items())).encode())

    def log_message(self, format: str, *args: object) -> None:
        return


async def test_an_http10_server_answers_an_http11_client() -> None:
    """The exchange alone, on loopback: a server that speaks HTTP/1.0 and ends its body by
    closing gets its response to the HTTP/1.1 client as HTTP/1.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Http10)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = await asyncio.open_connection("127.0.0.1", server.server_address[1])
        try:
            await exchange(PlainStream(reader, writer), PlainStream(*up), lambda: (SECRET,))
        finally:
            up[1].close()
            writer.close()

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        port = proxy.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        head, body = response.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"transfer-encoding: chunked" in head.lower()
        assert b"s3cret" in body
    finally:
        proxy.close()
        server.shutdown()
        server.server_close()
        thread.join()


async def _trailing_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1: answers with the request's headers and trailers, chunked, with a trailer."""
    conn = h11.Connection(h11.SERVER)
    request: list[tuple[str, str]] = []
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Request):
            request += [(n.decode(), v.decode()) for n, v in event.headers.raw_items()]
        elif isinstance(event, h11.EndOfMessage):
            request += [(n.decode(), v.decode()) for n, v in event.headers.raw_items()]
            break
    head = h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")])
    writer.write(conn.send(head) + conn.send(h11.Data(data=json.dumps(request).encode())))
    writer.write(conn.send(h11.EndOfMessage(headers=[("X-Checksum", "42")])))
    await writer.drain()
    writer.close()


async def test_http2_trailers_cross_both_ways() -> None:
    """The HTTP/2 bridge alone, on loopback without TLS: a request with a body and trailers
    reaches the HTTP/1.1 server chunked, with the rule's header; the response's trailer comes
    back as HTTP/2 trailers."""
    upstream = await asyncio.start_server(_trailing_server, "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]

    async def connect() -> PlainStream:
        return PlainStream(*await asyncio.open_connection("127.0.0.1", port))

    async def bridge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await Bridge(PlainStream(reader, writer), await connect(), connect, lambda: (SECRET,)).run()
        writer.close()

    proxy = await asyncio.start_server(bridge, "127.0.0.1", 0)
    client = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding="utf-8"))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])
    try:
        client.initiate_connection()
        request = [
            (":method", "POST"),
            (":path", "/"),
            (":authority", "a.test"),
            (":scheme", "https"),
        ]
        client.send_headers(1, request)
        client.send_data(1, b"body")
        client.send_headers(1, [("x-sum", "7")], end_stream=True)
        writer.write(client.data_to_send())
        body, trailers, ended = b"", [], False
        while not ended:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data
            for event in client.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    body += event.data
                    client.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, h2.events.TrailersReceived):
                    trailers = list(event.headers)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            writer.write(client.data_to_send())
        seen = dict((n.lower(), v) for n, v in json.loads(body))
        assert (seen["x-api-key"], seen["x-sum"], seen["host"]) == ("s3cret", "7", "a.test")
        assert seen["transfer-encoding"] == "chunked"
        assert trailers == [("x-checksum", "42")]
    finally:
        writer.close()
        proxy.close()
        upstream.close()


# A gRPC server (grpcio: HTTP/2 only) answering `Echo` with the metadata it got and a trailer,
# and `Chat` (streaming both ways) with each message reversed, then a trailer.
_GRPC_SERVER = """
import json, sys
from concurrent import futures
import grpc
key, chain, address, port = sys.argv[1:]

def echo(request, context):
    context.set_trailing_metadata((("x-trailer", "echoed-%d" % len(request)),))
    return json.dumps([list(m) for m in context.invocation_metadata()]).encode()

def chat(requests, context):
    context.send_initial_metadata((("x-initial", "hi"),))
    for message in requests:
        yield message[::-1]
    context.set_trailing_metadata((("x-trailer", "chatted"),))

handler = grpc.method_handlers_generic_handler("echo.Echo", {
    "Echo": grpc.unary_unary_rpc_method_handler(echo),
    "Chat": grpc.stream_stream_rpc_method_handler(chat),
})
server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[handler])
credentials = grpc.ssl_server_credentials([(open(key, "rb").read(), open(chain, "rb").read())])
server.add_secure_port(f"{address}:{port}", credentials)
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""
_GRPC_CLIENT = """
import json, sys
import grpc
bundle, target = sys.argv[1:]
credentials = grpc.ssl_channel_credentials(open(bundle, "rb").read())
with grpc.secure_channel(target, credentials) as channel:
    echo = channel.unary_unary("/echo.Echo/Echo")
    answer, call = echo.with_call(b"hello", metadata=(("x-api-key", "guest"),), timeout=20)
    print(json.dumps({"metadata": json.loads(answer), "trailers": list(call.trailing_metadata())}))
    big = b"".join(b"%07d" % i for i in range(100_000))  # 700 kB: more than a window
    chat = channel.stream_stream("/echo.Echo/Chat")(iter([b"abc", big]), timeout=20)
    messages = [m.decode() if len(m) < 100 else m == big[::-1] for m in chat]
    print(json.dumps({
        "messages": messages,
        "initial": list(chat.initial_metadata()),
        "trailers": list(chat.trailing_metadata()),
    }))
"""


async def test_grpc_through_a_ruled_name(
    make_pool: MakePool, boot: Boot, world: World, origin_ca: trustme.CA, tmp_path: Path
) -> None:
    """A gRPC server in the internet (HTTP/2 only, trailers, streaming both ways), called from
    the guest with grpcio through a name with a rule: the server chose HTTP/2, so each of the
    guest's streams goes on as a stream; the rule's header reaches the server's metadata (in
    place of the guest's own), trailers and initial metadata come back, and messages larger
    than HTTP/2's windows cross both ways."""
    leaf = origin_ca.issue_cert("grpc.test")
    key, chain, pem = tmp_path / "key.pem", tmp_path / "chain.pem", tmp_path / "origin.pem"
    leaf.private_key_pem.write_to_path(str(key))
    chain.write_bytes(b"".join(blob.bytes() for blob in leaf.cert_chain_pems))
    origin_ca.cert_pem.write_to_path(str(pem))
    server = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", world.inet, sys.executable, "-c", _GRPC_SERVER,
        str(key), str(chain), INET_IP, "50051", stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        assert await asyncio.wait_for(server.stdout.readline(), 30) == b"ready\n"
        rules = HeaderRules((HeaderRule("grpc.test", (SECRET,)),))
        policy = EgressPolicy.parse(allow=["grpc.test"], deny=["0.0.0.0/0"], headers=rules)
        pool = await make_pool(egress_ca=tmp_path / "ca", upstream_ca=pem)
        async with _named(await boot(await pool.acquire(policy=policy))) as guest:
            env = {"PATH": "/usr/bin:/bin", "GRPC_DNS_RESOLVER": "native"}
            code, out = await _run(
                guest, sys.executable, "-c", _GRPC_CLIENT, str(_bundle(tmp_path, pem)),
                "grpc.test:50051", env=env,
            )  # fmt: skip
        assert code == 0, out
        unary, streamed = (json.loads(line) for line in out.splitlines() if line.startswith("{"))
        metadata = dict(unary["metadata"])
        assert metadata["x-api-key"] == "s3cret"  # the rule's value, not the guest's
        assert [value for name, value in unary["metadata"] if name == "x-api-key"] == ["s3cret"]
        assert unary["trailers"] == [["x-trailer", "echoed-5"]]
        assert streamed["messages"] == ["cba", True]  # the big one, reversed
        assert streamed["initial"] == [["x-initial", "hi"]]
        assert streamed["trailers"] == [["x-trailer", "chatted"]]
    finally:
        server.terminate()
        await server.wait()


def _client_hello(alpn: list[str] | None) -> bytes:
    context = ssl.create_default_context()
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    out = ssl.MemoryBIO()
    client = context.wrap_bio(ssl.MemoryBIO(), out, server_hostname="a.test")
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    return out.read()


def test_the_protocols_a_client_hello_offers() -> None:
    """What the proxy offers a server follows what the guest offered (`sniff.tls_alpn`)."""
    assert tls_alpn(_client_hello(["h2", "http/1.1"])) == ("h2", "http/1.1")
    assert tls_alpn(_client_hello(["http/1.1"])) == ("http/1.1",)
    assert tls_alpn(_client_hello(None)) == ()
    hello = _client_hello(["h2"])
    assert [tls_alpn(hello[:cut]) for cut in (0, 5, 40)] == [()] * 3
    assert tls_alpn(b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n") == ()


async def _h2_server(
    seen: list[object], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """HTTP/2 without TLS: `/reset` is reset with ENHANCE_YOUR_CALM, `/hang` is answered with
    headers only (its reset by the client is recorded in `seen`), anything else with its
    request headers as JSON."""
    config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
    conn = h2.connection.H2Connection(config)
    conn.initiate_connection()
    writer.write(conn.data_to_send())
    try:
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    assert event.stream_id is not None and event.headers is not None
                    headers = {str(n): str(v) for n, v in event.headers}
                    seen.append(headers)
                    if headers[":path"] == "/reset":
                        conn.reset_stream(event.stream_id, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
                    elif headers[":path"] == "/hang":
                        conn.send_headers(event.stream_id, [(":status", "200")])
                    else:
                        body = json.dumps(headers).encode()
                        conn.send_headers(event.stream_id, [(":status", "200")])
                        conn.send_data(event.stream_id, body, end_stream=True)
                elif isinstance(event, h2.events.StreamReset):
                    seen.append(("reset", event.error_code))
            writer.write(conn.data_to_send())
    finally:
        writer.close()


async def test_http2_servers_get_streams_and_resets_both_ways() -> None:
    """The HTTP/2 bridge alone, on loopback without TLS, to a server that speaks HTTP/2 (as if
    it chose `h2` by ALPN): the request goes on as a stream with the rule's header (lower-cased,
    in place of the guest's); a reset by the server reaches the guest with its error code, a
    reset by the guest reaches the server."""
    seen: list[object] = []
    upstream = await asyncio.start_server(partial(_h2_server, seen), "127.0.0.1", 0)
    port = upstream.sockets[0].getsockname()[1]

    async def connect() -> PlainStream:
        return PlainStream(*await asyncio.open_connection("127.0.0.1", port), alpn="h2")

    async def bridge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await Bridge(PlainStream(reader, writer), await connect(), connect, lambda: (SECRET,)).run()
        writer.close()

    proxy = await asyncio.start_server(bridge, "127.0.0.1", 0)
    client = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding="utf-8"))
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.sockets[0].getsockname()[1])

    def request(stream_id: int, path: str) -> None:
        client.send_headers(
            stream_id,
            [(":method", "GET"), (":path", path), (":authority", "a.test"), (":scheme", "https"),
             ("x-api-key", "guest")],
            end_stream=True,
        )  # fmt: skip

    async def until(done: Callable[[list[h2.events.Event]], bool]) -> list[h2.events.Event]:
        events: list[h2.events.Event] = []
        while not done(events):
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data
            events += client.receive_data(data)
            writer.write(client.data_to_send())
        return events

    try:
        client.initiate_connection()
        request(1, "/")
        request(3, "/reset")
        writer.write(client.data_to_send())
        events = await until(
            lambda events: {getattr(e, "stream_id", 0) for e in events if isinstance(
                e, h2.events.StreamEnded | h2.events.StreamReset)} >= {1, 3}
        )  # fmt: skip
        body = b"".join(e.data or b"" for e in events if isinstance(e, h2.events.DataReceived))
        got = json.loads(body)
        assert (got["x-api-key"], got[":authority"]) == ("s3cret", "a.test")
        resets = [e for e in events if isinstance(e, h2.events.StreamReset)]
        assert [(e.stream_id, e.error_code) for e in resets] == [
            (3, h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        ]
        request(5, "/hang")
        writer.write(client.data_to_send())
        await until(lambda events: any(isinstance(e, h2.events.ResponseReceived) for e in events))
        client.reset_stream(5, h2.errors.ErrorCodes.CANCEL)
        writer.write(client.data_to_send())
        for _ in range(100):
            if ("reset", h2.errors.ErrorCodes.CANCEL) in seen:
                break
            await asyncio.sleep(0.05)
        assert ("reset", h2.errors.ErrorCodes.CANCEL) in seen
    finally:
        writer.close()
        proxy.close()
        upstream.close()


async def test_bodies_relayed_raw_keep_requests_apart() -> None:
    """The exchange alone, on loopback: responses framed by Content-Length go on as raw bytes
    (h11 sees their heads only), and the connections still serve pipelined requests in order
    and end after `Connection: close`."""
    seen: list[str] = []
    server = await asyncio.start_server(partial(_echo, seen), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up = await asyncio.open_connection("127.0.0.1", port)
        try:
            await exchange(PlainStream(reader, writer), PlainStream(*up), lambda: (SECRET,))
        finally:
            up[1].close()
            writer.close()

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", proxy.sockets[0].getsockname()[1]
        )
        writer.write(
            b"GET /big HTTP/1.1\r\nHost: a.test\r\n\r\n"
            b"POST /0 HTTP/1.1\r\nHost: a.test\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /1 HTTP/1.1\r\nHost: a.test\r\n\r\n"
            b"GET /2 HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n"
        )
        response = await asyncio.wait_for(reader.read(), 10)  # to the end: closed after /2
        writer.close()
        client = h11.Connection(h11.CLIENT)
        client.receive_data(response)
        bodies: list[bytes] = []
        for method in (b"GET", b"POST", b"GET", b"GET"):
            client.send(h11.Request(method=method, target="/", headers=[("Host", "a.test")]))
            client.send(h11.EndOfMessage())
            body = b""
            while not isinstance(event := client.next_event(), h11.EndOfMessage):
                assert event is not h11.NEED_DATA, bodies
                if isinstance(event, h11.Data):
                    body += event.data
            bodies.append(body)
            if client.our_state is h11.DONE and client.their_state is h11.DONE:
                client.start_next_cycle()
        assert seen == ["/big", "/0", "/1", "/2"]
        assert bodies[0] == bytes(BIG)
        assert json.loads(bodies[1])["size"] == 3
        assert [_got(b.decode())["x-api-key"] for b in bodies[1:]] == [["s3cret"]] * 3
    finally:
        proxy.close()
        server.close()
