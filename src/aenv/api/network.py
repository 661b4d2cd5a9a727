"""A sandbox's network settings at the HTTP edge: from the create body's `network` and the
`PUT /sandboxes/{id}/network` body, and to the `network` object of the sandbox's info.

What this node does not implement is refused with a 400 naming the field, never accepted and
ignored: keys the SDKs do not send (models.Egress), and `rules` keyed by an address (they
apply to names: the egress proxy matches them against TLS SNI).
An `egressProxy`'s password and CA certificates are never shown back (as in E2B), nor the
values of the headers `rules` set: they are credentials, shown as `REDACTED`, but for one that
is a secret's or a workload token's marker (`${e2b.secrets.<name>}`,
`${e2b.identity.tokens.<name>}`), shown as it is (`header_rules.shown`). A create's `iam`
(workload identity, network/identity.py) is kept with the network settings, whose rules may
name its tokens; a rule naming a token it does not define is refused.
"""

from __future__ import annotations

import re
from ipaddress import IPv4Address
from typing import Any

from aenv.api.errors import APIError
from aenv.api.models import (
    Egress,
    EgressProxyBody,
    NetworkConfig,
    NetworkRule,
    NetworkUpdate,
    SandboxIam,
)
from aenv.envd import ENVD_PORT
from aenv.network.domains import is_address, normalise
from aenv.network.header_rules import NO_RULES, HeaderRule, HeaderRules, shown
from aenv.network.identity import NO_TOKENS, TOKEN_TYPE, IdentityTokens
from aenv.network.settings import SandboxNetwork
from aenv.network.socks import SocksProxy

MAX_DNS_SERVERS = 8
MAX_RULES = 256
# A host name or address with an optional port; `${PORT}` may stand for the port. It becomes a
# request header, so nothing that could end or extend one (whitespace, control characters).
_MASK = re.compile(r"[A-Za-z0-9.\-_\[\]:${}]{1,255}")


def _header_rules(rules: dict[str, list[NetworkRule]] | None) -> HeaderRules:
    if not rules:
        return NO_RULES
    out = []
    for domain, entries in rules.items():
        if is_address(domain):
            message = f"network.rules: {domain!r}: rules apply to domain names, not addresses"
            raise APIError(400, message)
        for entry in entries:
            headers = entry.transform.headers if entry.transform else None
            try:
                out.append(HeaderRule(domain, tuple((headers or {}).items())))
            except ValueError as e:
                raise APIError(400, f"network.rules: {domain!r}: {e}") from e
    if len(out) > MAX_RULES:
        raise APIError(400, f"network.rules: at most {MAX_RULES} rules")
    return HeaderRules(tuple(out))


def _destinations(field: str, entries: list[str] | None) -> tuple[str, ...]:
    for entry in entries or ():
        if is_address(entry):
            continue
        if field == "denyOut":
            message = f"network.denyOut: {entry!r} is not an IP address or CIDR (domain names "
            raise APIError(400, message + "are not supported for deny rules)")
        try:
            normalise(entry)
        except ValueError as e:
            raise APIError(400, f"network.{field}: {e}") from e
    return tuple(entries or ())


def _socks_proxy(body: EgressProxyBody | None) -> SocksProxy | None:
    if body is None:
        return None
    tls = body.tls
    try:
        return SocksProxy.parse(
            body.address,
            username=body.username,
            password=body.password,
            tls=tls is not None and tls.enabled,
            server_name=tls.server_name if tls else None,
            ca_cert=tls.ca_cert if tls else None,
        )
    except ValueError as e:
        raise APIError(400, f"network.egressProxy: {e}") from e


def _dns_servers(servers: list[str] | None) -> tuple[str, ...] | None:
    if servers is None:
        return None
    if len(servers) > MAX_DNS_SERVERS:
        raise APIError(400, f"network.dnsServers: at most {MAX_DNS_SERVERS}")
    for server in servers:
        try:
            IPv4Address(server)
        except ValueError:
            raise APIError(400, f"network.dnsServers: {server!r} is not an IPv4 address") from None
    return tuple(servers)


def identity_tokens(body: SandboxIam | None) -> IdentityTokens:
    """A create's `iam` (400 for a type other than E2B's one, or a token E2B would refuse)."""
    tokens = (body.tokens if body is not None else None) or {}
    for name, token in tokens.items():
        if token.token_type != TOKEN_TYPE:
            message = f"iam.tokens.{name}.tokenType: only {TOKEN_TYPE!r} is supported"
            raise APIError(400, message)
    try:
        return IdentityTokens(tuple((name, token.audience) for name, token in tokens.items()))
    except ValueError as e:
        raise APIError(400, f"iam.tokens: {e}") from e


def _network(allow_internet: bool, body: Egress, **ingress: Any) -> SandboxNetwork:
    allow_out = _destinations("allowOut", body.allow_out)
    deny_out = _destinations("denyOut", body.deny_out)
    proxy = _socks_proxy(body.egress_proxy)
    resolvers = _dns_servers(body.dns_servers)
    try:
        return SandboxNetwork(
            allow_internet,
            allow_out,
            deny_out,
            egress_proxy=proxy,
            dns_servers=resolvers,
            rules=_header_rules(body.rules),
            **ingress,
        )
    except ValueError as e:  # IPv6 (guests have none), or names without a deny of everything
        raise APIError(400, f"network: {e}") from e


def create_network(
    allow_internet_access: bool | None,
    body: NetworkConfig | None,
    iam: IdentityTokens = NO_TOKENS,
) -> SandboxNetwork:
    """The settings of a new sandbox from its create body, with its workload identity tokens
    (400 for what cannot be honoured)."""
    body = body or NetworkConfig()
    mask = body.mask_request_host
    if mask is not None and not _MASK.fullmatch(mask):
        raise APIError(400, f"network.maskRequestHost: not a host[:port]: {mask!r}")
    return _network(
        allow_internet_access is not False,
        body,
        allow_public_traffic=body.allow_public_traffic is not False,
        mask_request_host=mask,
        https_ports=_https_ports(body.https_ports or []),
        iam=iam,
    )


def _https_ports(ports: list[int]) -> tuple[int, ...]:
    for port in ports:
        if not 0 < port < 65536:
            raise APIError(400, f"network.httpsPorts: {port} is not a port")
        if port == ENVD_PORT:  # the SDKs speak plain HTTP to envd
            raise APIError(400, f"network.httpsPorts: {port} is envd's port")
    return tuple(sorted(set(ports)))


def updated_network(body: NetworkUpdate, iam: IdentityTokens = NO_TOKENS) -> SandboxNetwork:
    """The egress part of `PUT /sandboxes/{id}/network` (its ingress fields are left out),
    its rules checked against the sandbox's workload identity tokens `iam`."""
    return _network(body.allow_internet_access is not False, body, iam=iam)


def network_info(network: SandboxNetwork) -> dict[str, Any]:
    """E2B's `SandboxNetworkConfig`, as the sandbox's info shows it."""
    info: dict[str, Any] = {
        "allowOut": list(network.allow_out),
        "denyOut": list(network.deny_out),
        "allowPublicTraffic": network.allow_public_traffic,
    }
    if network.mask_request_host is not None:
        info["maskRequestHost"] = network.mask_request_host
    if network.https_ports:
        info["httpsPorts"] = list(network.https_ports)
    if network.dns_servers is not None:
        info["dnsServers"] = list(network.dns_servers)
    if network.rules.rules:
        rules: dict[str, list[dict[str, Any]]] = {}
        for rule in network.rules.rules:
            redacted = {name: shown(value) for name, value in rule.headers}
            rules.setdefault(rule.domain, []).append(
                {"transform": {"headers": redacted}} if redacted else {}
            )
        info["rules"] = rules
    if (proxy := network.egress_proxy) is not None:
        proxy_info: dict[str, Any] = {"address": proxy.address}
        if proxy.username is not None:
            proxy_info["username"] = proxy.username
        if proxy.tls:
            proxy_info["tls"] = {"enabled": True}
            if proxy.server_name is not None:
                proxy_info["tls"]["serverName"] = proxy.server_name
        info["egressProxy"] = proxy_info
    return info
