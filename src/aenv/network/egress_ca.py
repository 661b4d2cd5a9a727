"""The node's egress CA: the certificate authority whose certificates a slot's egress proxy
shows a guest when it terminates TLS to apply header rules (`interception`).

One CA per node, not per cluster or team: its private key never leaves the node (0600 in
`Paths.egress_ca`, read by the server alone), so no key is shipped between machines, and a
node that is lost takes no other node's trust with it. A sandbox that moves to another node
is given that node's certificate when it is restored there (`orchestrator`). Only the
certificate enters a guest, and only a guest whose sandbox has header rules.

Leaf certificates are made on demand, one per server name, valid for a few days, signed by
the CA and kept in memory (LRU). They share one key made at start: a leaf key protects only
connections between the guest and this node.
"""

from __future__ import annotations

import datetime
import os
import ssl
import tempfile
from collections import OrderedDict
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_KEY = "ca.key"
CA_CERT = "ca.pem"
_CA_YEARS = 10
_LEAF_DAYS = 7
_LEAVES = 1024


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _new_ca(directory: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = _name("aenv egress CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(days=1))
        .not_valid_after(_now() + datetime.timedelta(days=365 * _CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # The certificate last: a directory with a certificate has its key.
    _write_private(directory / CA_KEY, pem_key)
    (directory / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))


class EgressCA:
    """The CA in `directory`, made there (0700, key 0600) on first use."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (directory / CA_CERT).exists():
            (directory / CA_KEY).unlink(missing_ok=True)
            _new_ca(directory)
        self._dir = directory
        self.cert_pem = (directory / CA_CERT).read_bytes()
        self._cert = x509.load_pem_x509_certificate(self.cert_pem)
        key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        self._key = key
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())
        self._leaves: OrderedDict[str, ssl.SSLContext] = OrderedDict()

    def server_context(self, name: str) -> ssl.SSLContext:
        """A TLS server context showing a certificate for `name`, speaking HTTP/2 or 1.1."""
        context = self._leaves.get(name)
        if context is not None:
            self._leaves.move_to_end(name)
            return context
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["h2", "http/1.1"])
        # ssl loads a chain from files only: a private temporary file, gone once loaded.
        with tempfile.NamedTemporaryFile(dir=self._dir, suffix=".pem") as f:
            f.write(self._leaf_pem(name))
            f.flush()
            context.load_cert_chain(f.name)
        self._leaves[name] = context
        if len(self._leaves) > _LEAVES:
            self._leaves.popitem(last=False)
        return context

    def _leaf_pem(self, name: str) -> bytes:
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self._cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - datetime.timedelta(days=1))
            .not_valid_after(_now() + datetime.timedelta(days=_LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        key = self._leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return cert.public_bytes(serialization.Encoding.PEM) + key


def upstream_context(extra_ca: Path | None, http2: bool = False) -> ssl.SSLContext:
    """How the proxy checks the real server: the host's trust store, plus the operator's CA
    bundle if one is given. It offers HTTP/1.1, and HTTP/2 first with `http2` (for a guest that
    offered HTTP/2 itself: `interception_h2`)."""
    context = ssl.create_default_context()
    if extra_ca is not None:
        context.load_verify_locations(cafile=str(extra_ca))
    context.set_alpn_protocols(["h2", "http/1.1"] if http2 else ["http/1.1"])
    return context
