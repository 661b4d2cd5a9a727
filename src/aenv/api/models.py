"""Request bodies of the E2B control plane, validated at the HTTP edge.

Field names are the SDKs' JSON keys. A key a model does not declare is refused (api/requests.py
names it in the 400): E2B fields this node does not implement (`mcp`...)
are left undeclared on purpose, so a client asking for them learns it at once instead of getting
a sandbox without them.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from aenv.config import MAX_VOLUME_MB, MIN_VOLUME_MB
from aenv.network.header_rules import HEADER_VALUE
from aenv.network.header_rules import MAX_VALUE as MAX_SECRET_VALUE
from aenv.orchestrator.events import EventType

DEFAULT_TIMEOUT_V1 = 15
DEFAULT_TIMEOUT_V2 = 300
MAX_FORK = 100
# E2B's spec types timeouts as int32; beyond that an end time leaves the range of dates the API
# can print, and every later listing of the sandbox would fail.
MAX_SECONDS = 2**31 - 1
MAX_REFRESH = 3600  # E2B's limit on `POST /sandboxes/{id}/refreshes`
# Metadata and env vars live in the catalog row, are listed with every sandbox and are handed to
# envd at each start: bounded, so one client cannot bloat what every listing and start carries.
MAX_METADATA_ENTRIES = 64
MAX_METADATA_BYTES = 16 * 1024
MAX_ENV_VARS = 1024
MAX_ENV_BYTES = 256 * 1024


def _size(entries: dict[str, str]) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in entries.items())


def check_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ValueError(f"at most {MAX_METADATA_ENTRIES} entries")
    if _size(metadata) > MAX_METADATA_BYTES:
        raise ValueError(f"at most {MAX_METADATA_BYTES} bytes of keys and values")
    return metadata


def _check_env_vars(env_vars: dict[str, str]) -> dict[str, str]:
    if len(env_vars) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} variables")
    if _size(env_vars) > MAX_ENV_BYTES:
        raise ValueError(f"at most {MAX_ENV_BYTES} bytes of names and values")
    for name, value in env_vars.items():
        # What a process environment cannot hold (execve would fail, or split the entry).
        if not name or "=" in name or "\0" in name or "\0" in value:
            raise ValueError(f"invalid variable {name!r}: no empty name, '=' in it or NUL")
    return env_vars


Metadata = Annotated[dict[str, str], AfterValidator(check_metadata)]
EnvVars = Annotated[dict[str, str], AfterValidator(_check_env_vars)]
Seconds = Annotated[int, Field(ge=0, le=MAX_SECONDS)]


class _Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class EgressProxyTls(_Body):
    enabled: bool = False
    server_name: str | None = Field(default=None, alias="serverName")
    ca_cert: str | None = Field(default=None, alias="caCert")


class EgressProxyBody(_Body):
    """`network.egressProxy`: a SOCKS5 proxy as `host:port`, optional RFC 1929 credentials."""

    address: str
    username: str | None = None
    password: str | None = None
    tls: EgressProxyTls | None = None


class NetworkTransform(_Body):
    """A rule's `transform`: the headers set on the requests it matches."""

    headers: dict[str, str] | None = None


class NetworkRule(_Body):
    """One of a domain's `network.rules`."""

    transform: NetworkTransform | None = None


class Egress(BaseModel):
    """Egress fields shared by a create's `network` and `PUT /sandboxes/{id}/network`. Every
    key the SDKs send is declared, and unknown keys are refused: a firewall rule accepted and
    then ignored would be worse than an error (api/network.py refuses what is not implemented)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")
    rules: dict[str, list[NetworkRule]] | None = None
    egress_proxy: EgressProxyBody | None = Field(default=None, alias="egressProxy")
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers")


class NetworkConfig(Egress):
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost")
    https_ports: list[int] | None = Field(default=None, alias="httpsPorts")


class NetworkUpdate(Egress):
    """`PUT /sandboxes/{id}/network`: replaces every egress rule; an omitted field is cleared."""

    allow_internet_access: bool | None = None


class SandboxIamToken(_Body):
    """One of E2B's `iam.tokens`; JWT-SVID is the only type E2B's API takes (api/network.py)."""

    audience: str
    token_type: str = Field(alias="tokenType")


class SandboxIam(_Body):
    """E2B's `iam`: a non-empty `tokens` map enables workload identity (network/identity.py)."""

    tokens: dict[str, SandboxIamToken] | None = None


class AutoResume(_Body):
    enabled: bool = False


class SandboxVolumeMount(_Body):
    """A volume (by name) and the guest path it is mounted at; both checked in api/volumes.py."""

    name: str
    path: str


class NewVolume(_Body):
    """`POST /volumes`; the name's rules are `orchestrator.volumes.check_name`'s. `sizeMB` is
    this node's (E2B's volumes have no size): the node's `volume_size_mb` when absent."""

    name: str
    size_mb: int | None = Field(
        default=None, alias="sizeMB", ge=MIN_VOLUME_MB, le=MAX_VOLUME_MB, strict=True
    )


# Webhooks are rows of the catalog, listed whole: bounded like metadata.
MAX_WEBHOOK_TEXT = 2048
_WebhookText = Annotated[str, Field(min_length=1, max_length=MAX_WEBHOOK_TEXT)]
_WebhookEvents = Annotated[list[EventType], Field(min_length=1, max_length=len(EventType))]


class NewWebhook(_Body):
    """`POST /events/webhooks`."""

    name: _WebhookText
    url: _WebhookText
    enabled: bool = True
    events: _WebhookEvents
    signature_secret: _WebhookText = Field(alias="signatureSecret")


class WebhookChanges(_Body):
    """`PATCH /events/webhooks/{webhookID}`: the fields given replace the webhook's."""

    name: _WebhookText | None = None
    url: _WebhookText | None = None
    enabled: bool | None = None
    events: _WebhookEvents | None = None
    signature_secret: _WebhookText | None = Field(default=None, alias="signatureSecret")


# E2B's limits of a secret's metadata (`SecretMetadata`).
MAX_SECRET_METADATA_ENTRIES = 32
MAX_SECRET_METADATA_KEY = 128
MAX_SECRET_METADATA_VALUE = 1024
MAX_SECRET_METADATA_BYTES = 8192


def _check_secret_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_SECRET_METADATA_ENTRIES:
        raise ValueError(f"at most {MAX_SECRET_METADATA_ENTRIES} entries")
    for key, value in metadata.items():
        if len(key.encode()) > MAX_SECRET_METADATA_KEY:
            raise ValueError(f"key {key[:32]!r}...: at most {MAX_SECRET_METADATA_KEY} bytes")
        if len(value.encode()) > MAX_SECRET_METADATA_VALUE:
            raise ValueError(f"the value of {key!r}: at most {MAX_SECRET_METADATA_VALUE} bytes")
    if _size(metadata) > MAX_SECRET_METADATA_BYTES:
        raise ValueError(f"at most {MAX_SECRET_METADATA_BYTES} bytes of keys and values")
    return metadata


def _check_secret_value(value: str) -> str:
    """A value is sent as (part of) a header: what a header cannot carry is refused now, not
    at each request. The message never shows the value."""
    if len(value) > MAX_SECRET_VALUE or not HEADER_VALUE.fullmatch(value):
        raise ValueError(
            f"a secret's value is sent in a request header: at most {MAX_SECRET_VALUE} "
            "characters, no control characters (but tab), no leading or trailing space"
        )
    return value


SecretMetadata = Annotated[dict[str, str], AfterValidator(_check_secret_metadata)]
SecretValue = Annotated[str, AfterValidator(_check_secret_value)]


class NewSecret(_Body):
    """`POST /secrets`. The name is lower-cased before it is stored (api/secrets.py)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]+$")
    value: SecretValue
    metadata: SecretMetadata | None = None


class SecretUpdate(_Body):
    """`POST /secrets/{secretID}`: a new version; `metadata`, when given, replaces it."""

    value: SecretValue
    metadata: SecretMetadata | None = None


class NewSandbox(_Body):
    """`POST /sandboxes` (v1) and `POST /v2/sandboxes`; only the default timeout differs."""

    template_id: str = Field(alias="templateID", min_length=1)
    timeout: Seconds | None = None
    metadata: Metadata | None = None
    env_vars: EnvVars | None = Field(default=None, alias="envVars")
    auto_pause: bool = Field(default=False, alias="autoPause")
    auto_pause_memory: bool = Field(default=True, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    # Every envd here requires the sandbox's access token; `false` is refused in api/sandboxes.py.
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None
    volume_mounts: list[SandboxVolumeMount] | None = Field(default=None, alias="volumeMounts")
    iam: SandboxIam | None = None


class TimeoutBody(_Body):
    timeout: Seconds


class ConnectBody(_Body):
    timeout: Seconds | None = None
    # False: cold-boot from the disks, ignoring the memory snapshot (`on_resume="reboot"`).
    memory: bool = True


class ResumeBody(_Body):
    """`POST /sandboxes/{id}/resume` (SDKs 2.0-2.19)."""

    timeout: Seconds | None = None
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    memory: bool = True


class PauseBody(_Body):
    # False: save only the filesystem; the sandbox cold-boots from it on resume.
    memory: bool = True
    require_healthy_guest: bool = Field(default=False, alias="requireHealthyGuest")


class SnapshotBody(_Body):
    name: str | None = Field(default=None, min_length=1, max_length=128)
    memory: bool = True


class ForkBody(_Body):
    # Not nullable in E2B's spec (the SDKs leave it out instead): null is refused, not a default.
    timeout: int = Field(default=DEFAULT_TIMEOUT_V2, ge=1, le=MAX_SECONDS)
    count: int = Field(default=1, ge=1, le=MAX_FORK)


class ForkChild(_Body):
    """One child of a batch fork: what it adds to its source's metadata and env vars."""

    metadata: Metadata | None = None
    env_vars: EnvVars | None = Field(default=None, alias="envVars")


class BatchForkBody(_Body):
    """`POST /aenv/sandboxes/{id}/fork` (this node's extension): one entry per child."""

    timeout: int = Field(default=DEFAULT_TIMEOUT_V2, ge=1, le=MAX_SECONDS)
    children: list[ForkChild] = Field(min_length=1, max_length=MAX_FORK)


class ResetBody(_Body):
    """`POST /aenv/sandboxes/{id}/reset` (this node's extension): the saved state to go back to."""

    snapshot_id: str = Field(alias="snapshotID", min_length=1, max_length=256)
    # Seconds the sandbox then runs (E2B's `set_timeout`, at once); absent: its end stays.
    timeout: int | None = Field(default=None, ge=1, le=MAX_SECONDS)


class RefreshBody(_Body):
    duration: int | None = Field(default=None, ge=0, le=MAX_REFRESH)
