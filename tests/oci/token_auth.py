"""A token realm for docker-registry's `token` auth, run in the test: Starlette on uvicorn in a
thread. It checks Basic credentials and answers with an ES256 JWT (signed with a throwaway
self-signed certificate the registry trusts) granting the scope that was asked for."""

from __future__ import annotations

import base64
import datetime
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.x509.oid import NameOID
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.support.ports import free_port

SERVICE = "aenv-test-registry"
ISSUER = "aenv-test-issuer"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenRealm:
    url: str
    cert_bundle: Path
    requests: list[str]  # scopes asked for, in order

    def registry_auth(self) -> dict[str, Any]:
        return {
            "token": {
                "realm": self.url,
                "service": SERVICE,
                "issuer": ISSUER,
                "rootcertbundle": str(self.cert_bundle),
            }
        }


def _certificate(key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "aenv-test-token")])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )


@contextmanager
def run_token_realm(workdir: Path, users: dict[str, str]) -> Iterator[TokenRealm]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(key)
    bundle = workdir / "token-ca.pem"
    bundle.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    x5c = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()
    asked: list[str] = []

    def sign(subject: str, scope: str) -> str:
        access = []
        if scope:
            kind, name, actions = scope.split(":")
            access = [{"type": kind, "name": name, "actions": actions.split(",")}]
        now = int(time.time())
        header = {"typ": "JWT", "alg": "ES256", "x5c": [x5c]}
        claims = {
            "iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + 300, "nbf": now - 10,
            "iat": now, "jti": secrets.token_hex(8), "access": access,
        }  # fmt: skip
        signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        r, s = decode_dss_signature(key.sign(signing_input.encode(), ec.ECDSA(hashes.SHA256())))
        return f"{signing_input}.{_b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"

    async def token(request: Request) -> Response:
        scope = request.query_params.get("scope", "")
        asked.append(scope)
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Basic "):
            return JSONResponse({"details": "credentials required"}, status_code=401)
        user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
        if users.get(user) != password:
            return JSONResponse({"details": "bad credentials"}, status_code=401)
        return JSONResponse({"token": sign(user, scope)})

    port = free_port()
    app = Starlette(routes=[Route("/token", token)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "token realm did not start"
            time.sleep(0.05)
        yield TokenRealm(f"http://127.0.0.1:{port}/token", bundle, asked)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
