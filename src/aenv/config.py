"""Server configuration: defaults that work on one machine, a TOML file, `AENV_*` env vars, and
`Paths`, the one place that names the files under the data directory.

Precedence: defaults < `$AENV_HOME/config.toml` (or `AENV_CONFIG`) < environment < explicit
overrides (CLI flags). Every key is a field of `Config`; env names are `AENV_` + the key in
upper case (`AENV_PORT=3001`). pydantic converts every value, so `AENV_PAUSE_ON_SHUTDOWN=false`
is False and `AENV_PORT=x` is an error naming the key.
"""

from __future__ import annotations

import hashlib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

DEFAULT_HOME = Path("/var/lib/aenv")
MAX_SHARE_SLOTS = 16
# Volume sizes (MiB): the smallest ext4 image mkfs makes usefully, and 1 TiB.
MIN_VOLUME_MB = 16
MAX_VOLUME_MB = 1 << 20
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# What template builds may reach by default: the registries of pip, npm and apt (Debian), by
# the names their clients use.
REGISTRIES = (
    "pypi.org",
    "files.pythonhosted.org",
    "registry.npmjs.org",
    "deb.debian.org",
    "security.debian.org",
)


class ConfigError(ValueError):
    """A configuration value that cannot be used."""


@dataclass(frozen=True)
class Paths:
    """Every file and directory the server keeps, named once.

    ```
    $AENV_HOME/
      config.toml              settings (`AENV_CONFIG` points elsewhere)
      api-key                  the first API key's value, the operator's copy (mode 0600)
      api-keys.json            every API key of the node, as SHA-256 digests (mode 0600)
      damon.json               the node's kdamond while cold reclaim runs (runtime/damon.py)
      cluster-drain.json       whether the node drains, as a cluster member (cluster/drain.py)
      catalog.db               the sandbox catalog (SQLite, WAL)
      template-tags.json       template tags
      templates/<id>/          template.json and its builds (saved states: templates,
                               snapshots, fork checkpoints, cached build steps, image bases)
      sandboxes/<id>/          a sandbox's VM work dir and pause checkpoints
      builds/<build>.json      template build records (status, reason)
      builds/<build>.log.db    a template build's log (SQLite, capped at `build_log_max_mb`)
      build-files/<template>/<hash>
                               files uploaded for template builds' COPY steps (tar, gzipped
                               or not); swept a day after their last use
      detach/                  scratch space of memory detaching
      repository/              the snapshot repository when it is a directory (the default)
      volumes/<id>/            a volume's files, shared by the sandboxes that mount it (the
                               mount point of its image while the node runs)
      volume-images/<id>.ext4  a volume's sparse ext4 image, of its size
      jailer/                  Firecracker's jailer chroots (Firecracker hosts only)
      cache/
        guest/                 guest build cache: kernel, initramfs, rootfs, the envd bundle
                               (`guest_cache`)
        images/                published guest images, content-addressed
        oci/                   OCI blob cache
        oci-rootfs/            ext4 root filesystems made from OCI images
        chunks/                repository chunk cache (LRU, `repository_cache_mb`)
    /dev/shm/aenv-<hash of $AENV_HOME>/
      <template id>/           saved guest memory every restore maps (tmpfs)
      sandboxes/<id>/          a sandbox's guest memory
      detach/                  memory detaching's scratch memory
    ```
    """

    home: Path
    guest_cache_override: Path | None = None

    @property
    def config_file(self) -> Path:
        return self.home / "config.toml"

    @property
    def api_key(self) -> Path:
        return self.home / "api-key"

    @property
    def api_keys(self) -> Path:
        return self.home / "api-keys.json"

    @property
    def damon(self) -> Path:
        return self.home / "damon.json"

    @property
    def cluster_drain(self) -> Path:
        return self.home / "cluster-drain.json"

    @property
    def catalog(self) -> Path:
        return self.home / "catalog.db"

    @property
    def template_tags(self) -> Path:
        return self.home / "template-tags.json"

    @property
    def templates(self) -> Path:
        return self.home / "templates"

    @property
    def sandboxes(self) -> Path:
        return self.home / "sandboxes"

    @property
    def builds(self) -> Path:
        return self.home / "builds"

    @property
    def build_files(self) -> Path:
        return self.home / "build-files"

    @property
    def detach(self) -> Path:
        return self.home / "detach"

    @property
    def repository(self) -> Path:
        return self.home / "repository"

    @property
    def volumes(self) -> Path:
        return self.home / "volumes"

    @property
    def volume_images(self) -> Path:
        return self.home / "volume-images"

    @property
    def jailer(self) -> Path:
        return self.home / "jailer"

    @property
    def cache(self) -> Path:
        """Where `prepare_images` publishes guest images and keeps the envd bundle."""
        return self.home / "cache"

    @property
    def guest_cache(self) -> Path:
        return self.guest_cache_override or self.cache / "guest"

    @property
    def oci_cache(self) -> Path:
        return self.cache / "oci"

    @property
    def oci_rootfs(self) -> Path:
        return self.cache / "oci-rootfs"

    @property
    def chunk_cache(self) -> Path:
        return self.cache / "chunks"

    @property
    def memory(self) -> Path:
        """Guest memory on tmpfs, one tree per data dir (restores map these files)."""
        digest = hashlib.sha256(str(self.home.resolve()).encode()).hexdigest()[:8]
        return Path("/dev/shm") / f"aenv-{digest}"


class Config(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    home: Path = DEFAULT_HOME
    host: str = "0.0.0.0"  # noqa: S104 - a server meant to be reached
    port: int = 3000
    # Public base domain for sandbox URLs (`{port}-{id}.{domain}`); None lets SDKs use theirs.
    domain: str | None = None
    # HTTPS instead of HTTP: a certificate (chain) and its key, in PEM files. For the SDKs to
    # need only `E2B_DOMAIN`, it must cover `api.<domain>` and `*.<domain>` (sandbox hosts).
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # VMM driver: auto | firecracker | qemu-kvm | qemu-tcg.
    driver: str = "auto"
    default_template: str = "base"
    sandbox_vcpus: int = 1
    sandbox_memory_mb: int = 512
    sandbox_disk_mb: int = 2048
    # Creates running at once; more wait in a queue instead of failing.
    max_concurrent_creates: PositiveInt = 8
    # Uploads to the snapshot repository at once (pause checkpoints, snapshots); more wait.
    # Each exports and hashes a whole state: unbounded, a restart or a burst of pauses would
    # spend every core on them while users resume.
    max_concurrent_uploads: PositiveInt = 2
    max_sandboxes: int = 256
    # Per API key: sandboxes running at once (creates and forks past it answer 429), and
    # control-plane requests a second on average and at once.
    key_max_sandboxes: int = 256
    key_requests_per_s: int = 100
    key_request_burst: int = 200
    # Free disk (of the data directory) and available memory the host keeps: under them,
    # creates answer 429 and pauses and snapshots fail, with nothing changed.
    reserve_disk_mb: int = 1024
    reserve_memory_mb: int = 256
    # Admission by memory: host memory counted for each create until it runs (a restored
    # guest's own pages), and the most nominal guest RAM the node runs, as a multiple of the
    # host's RAM. Past either, creates answer 429 (pooled VMs are given back first).
    admission_sandbox_mb: int = 64
    memory_overcommit: float = 10.0
    # Warm pools: restored, not yet initialised VMs kept per template, sized to its creates of
    # the last minute; 0 turns pools off.
    pool_max: int = 0
    # Longest timeout a client may ask for, in seconds.
    max_timeout: int = 24 * 3600
    # Names (`<prefix>-<n>`: namespaces, host interfaces, the nftables table) and host-side
    # addresses of the network slots. Unset, they are derived per node (aenv/claims.py), so
    # that nodes on one host never share them; a node whose settings meet a running node's is
    # refused.
    network_prefix: str | None = None
    network_cidr: IPv4Network | None = None
    # Comma-separated CIDRs. Sandboxes never reach private (10/8, 172.16/12, 192.168/16) or
    # CGNAT (100.64/10) addresses, except those in `network_private_allowed`, nor any in
    # `network_internal` (the cluster's own addresses, say).
    network_private_allowed: tuple[IPv4Network, ...] = ()
    network_internal: tuple[IPv4Network, ...] = ()
    # The resolver that sandboxes with domain rules, and template builds, get the addresses of
    # allowed names from. Default: the host's own (`host_resolver`).
    network_dns: IPv4Address | None = None
    warm_slots_low: int = 4
    warm_slots_high: int = 16
    # Graceful shutdown pauses running sandboxes (they are resumable after the restart).
    # Off, it kills them.
    pause_on_shutdown: bool = True
    # The snapshot repository holding durable copies of pauses and snapshots.
    # A directory (default: `$AENV_HOME/repository`), `s3://bucket[/prefix]`, or `off`.
    # S3 credentials come from the usual AWS environment.
    repository: str = ""
    # Another S3-speaking server for an `s3://` repository.
    repository_endpoint: str | None = None
    # Node-local cache of repository chunks, in MiB (least recently used chunks are evicted).
    repository_cache_mb: int = 8192
    # Template builds: how long a build's readyCmd may keep failing before the build fails.
    build_ready_timeout: int = 300
    # Template builds: the hosts RUN steps may reach (names, `*.` wildcards), the package
    # registries by default; the Debian mirror's host is added. Empty: builds have no network.
    build_egress: tuple[str, ...] = REGISTRIES
    # Template builds: CA certificates (PEM) RUN steps trust, so that they reach the registries
    # as the host does, through a TLS-intercepting proxy too. Empty: the image's own only.
    build_ca_bundle: Path | None = Path("/etc/ssl/certs/ca-certificates.crt")
    # Template builds: cached step layers kept (newest first); each holds a VM's memory and disk.
    build_cache_layers: int = 32
    # Template builds: the most of a build's log kept on disk, in MiB; past it the log keeps its
    # first and last halves and says how much it dropped between them.
    build_log_max_mb: PositiveInt = 8
    # Build code-interpreter-v1 (the code interpreter SDKs' template) in the background when
    # the node starts without it (aenv/publish.py). Its pip and apt steps need the registries.
    publish_code_interpreter: bool = True
    # The definition it builds; unset: the one in the package (aenv/code_interpreter).
    code_interpreter_definition: Path | None = None
    # Density (docs/density.md). KSM: the node starts the host's ksmd with this tuning (pages
    # scanned every `ksm_sleep_ms`) and puts the host's settings back when it stops; it merges
    # the pages restored guests wrote alike. Off by default: it costs host CPU.
    ksm: bool = False
    ksm_pages_to_scan: int = 1000
    ksm_sleep_ms: int = 20
    # Cold-memory reclaim (docs/density.md): the node's kdamond pages out VMM memory not
    # touched for this many seconds, to the swap the operator configured; at most
    # `cold_reclaim_mb_per_s` MiB and `cold_reclaim_ms_per_s` ms of the kdamond's time a
    # second. 0 (the default) turns it off; set, a host that cannot do it refuses to start.
    cold_reclaim_after: int = 0
    cold_reclaim_mb_per_s: int = 32
    cold_reclaim_ms_per_s: int = 20
    # Idle hibernation: a running sandbox with no data-plane traffic and no command running
    # for this many seconds is paused behind the API's back and woken by its next request
    # (docs/density.md). 0 (the default) turns it off: it stops background processes.
    hibernate_after: int = 0
    # QEMU under TCG: each VMM's translation cache, in MiB (a bound on what it may grow to).
    tcg_tb_mib: PositiveInt = 128
    # QEMU: share devices (virtio-9p) of every VM booted, unused ones over an empty read-only
    # directory, so that sandboxes restored from its snapshots mount up to this many volumes
    # (README: Volumes). 0: no VMM serves 9p unless its sandbox mounts volumes, whose creates
    # then boot. At most 16 (each is a virtio-mmio device; microvm has 24).
    share_slots: int = 2
    # Size of a volume whose create names none (`sizeMB`), MiB: its writes past it fail with
    # ENOSPC, and the free disk above `reserve_disk_mb` must hold what it has not written yet.
    volume_size_mb: int = Field(default=1024, ge=MIN_VOLUME_MB, le=MAX_VOLUME_MB)
    # Every VMM runs jailed (README: Threat model). Off is for benchmarks and debugging only.
    jail: bool = True
    # Jailed VMMs: `jail_uid_base` is their group; each VMM has one of the `jail_uid_count` uids
    # after it. Unset, the base is derived per node as the network settings are.
    jail_uid_base: PositiveInt | None = None
    jail_uid_count: PositiveInt = 65_536
    # The guest build cache (kernel, initramfs, base rootfs); default `$AENV_HOME/cache/guest`.
    guest_cache: Path | None = None
    # The Debian mirror the base root filesystem is bootstrapped from.
    debian_mirror: str = DEFAULT_MIRROR
    # Seconds a client has to send a request's head (line and headers) once it started it;
    # a slower one (slowloris) is disconnected.
    header_timeout: int = 30
    # Open client connections the port accepts; past it new ones are closed at once.
    max_connections: int = 4096
    # Largest request head (request line and headers) the port reads; a bigger one gets 431.
    max_header_bytes: int = 64 * 1024
    # Cluster node role (`aenv node` reads these; `aenv server` needs none): the Redis holding
    # the cluster's state, this node's id (default: the host name), the address gateways reach
    # it at (default: host:port), and the secret the cluster's nodes and gateways share.
    redis_url: str | None = None
    node_id: str | None = None
    node_address: str | None = None
    cluster_secret: str | None = None
    # Seconds between heartbeats, and how long a lease outlives the last one.
    heartbeat_interval: float = 5.0
    lease_ttl: float = 15.0

    @field_validator(
        "domain", "repository_endpoint", "guest_cache", "tls_cert", "tls_key", "redis_url",
        "node_id", "node_address", "cluster_secret", "network_dns", "build_ca_bundle",
        "network_prefix", "network_cidr", "jail_uid_base", mode="before",
    )  # fmt: skip
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        """An empty env var (`AENV_DOMAIN=`) means unset, as in a shell."""
        return None if value == "" else value

    @field_validator("share_slots")
    @classmethod
    def _share_slots(cls, value: int) -> int:
        if not 0 <= value <= MAX_SHARE_SLOTS:
            raise ValueError(f"must be between 0 and {MAX_SHARE_SLOTS}")
        return value

    @field_validator("network_private_allowed", "network_internal", "build_egress", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        """`AENV_NETWORK_INTERNAL=10.9.0.0/16,10.8.0.0/16`, as well as a TOML list."""
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @model_validator(mode="after")
    def _tls_pair(self) -> Config:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self

    @model_validator(mode="after")
    def _cold_reclaim_bounds(self) -> Config:
        if self.cold_reclaim_after < 0:
            raise ValueError("cold_reclaim_after is seconds, 0 or more")
        if self.cold_reclaim_mb_per_s < 1 or self.cold_reclaim_ms_per_s < 1:
            raise ValueError("cold_reclaim_mb_per_s and cold_reclaim_ms_per_s must be 1 or more")
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.tls_cert is not None else "http"

    @property
    def repository_dir(self) -> Path | None:
        """The repository's directory when it is one: `$AENV_HOME/repository` by default, a
        relative `repository` under home, an absolute one as given. None for `off` or a URL."""
        where = self.repository.strip()
        if where == "off" or "://" in where:
            return None
        return self.home / where if where else self.paths.repository

    @property
    def paths(self) -> Paths:
        return Paths(self.home, self.guest_cache)


def load(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """The effective configuration (raises ConfigError on unknown keys or unusable values)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    # A home given on the command line (`--home`) is where its config.toml is looked for too.
    given = (overrides or {}).get("home")
    home = Path(given) if given is not None else Path(env.get("AENV_HOME", str(DEFAULT_HOME)))
    config_file = Path(env.get("AENV_CONFIG", str(Paths(home).config_file)))
    if config_file.is_file():
        try:
            values.update(tomllib.loads(config_file.read_text()))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_file}: {e}") from e
    for name in Config.model_fields:
        if f"AENV_{name.upper()}" in env:
            values[name] = env[f"AENV_{name.upper()}"]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(values) - set(Config.model_fields))
    if unknown:
        raise ConfigError(f"unknown configuration keys: {', '.join(unknown)}")
    try:
        return Config.model_validate(values)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: cannot use {err['input']!r}: {err['msg']}"
            for err in e.errors()
        )
        raise ConfigError(problems) from e
