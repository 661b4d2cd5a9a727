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
    NonNegativeFloat,
    PositiveFloat,
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
      admin-token              the operator's credential for the admin routes (mode 0600)
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
      secrets.key              the key secrets are stored encrypted with, when
                               `secrets_key_file` names none (mode 0600)
      identity.key             the key workload identity tokens are signed with, on a node
                               outside a cluster (PEM, mode 0600)
      egress-ca/               the node's egress CA (`ca.pem`, `ca.key` mode 0600, the
                               directory 0700): header rules' TLS interception
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
    # Another root for the tmpfs tree (a test's node keeps its guest memory in its own dir).
    memory_override: Path | None = None

    @property
    def egress_ca(self) -> Path:
        return self.home / "egress-ca"

    @property
    def secrets_key(self) -> Path:
        return self.home / "secrets.key"

    @property
    def identity_key(self) -> Path:
        return self.home / "identity.key"

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
    def admin_token(self) -> Path:
        return self.home / "admin-token"

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
        if self.memory_override is not None:
            return self.memory_override
        digest = hashlib.sha256(str(self.home.resolve()).encode()).hexdigest()[:8]
        return Path("/dev/shm") / f"aenv-{digest}"

    def sandbox(self, sandbox_id: str) -> Path:
        """A sandbox's VM work dir and pause checkpoints."""
        return self.sandboxes / sandbox_id

    def sandbox_memory(self, sandbox_id: str) -> Path:
        """A sandbox's guest memory (tmpfs)."""
        return self.memory / "sandboxes" / sandbox_id

    @property
    def detach_memory(self) -> Path:
        """Memory detaching's scratch memory (tmpfs)."""
        return self.memory / "detach"


class Config(BaseModel):
    """Every setting of a node, gateway or CLI. Each field's description is its documentation:
    `docs/configuration.md` is generated from them (`make docs`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    home: Path = Field(
        default=DEFAULT_HOME,
        description="Data directory: catalog, API keys, templates, sandbox disks (`Paths` below).",
    )
    host: str = Field(
        default="0.0.0.0",  # noqa: S104 - a server meant to be reached
        description="Address the API and the data plane listen on.",
    )
    port: int = Field(default=3000, description="Port of the API and the data plane.")
    domain: str | None = Field(
        default=None,
        description="Public base domain for `<port>-<id>.<domain>` sandbox URLs; unset, the SDKs "
        "use their own (`E2B_DOMAIN`).",
    )
    tls_cert: Path | None = Field(
        default=None,
        description="Serve HTTPS with this certificate (chain, PEM) and `tls_key`. With `domain` "
        "and a certificate for `api.<domain>` and `*.<domain>`, the SDKs need only `E2B_DOMAIN`.",
    )
    tls_key: Path | None = Field(default=None, description="The private key (PEM) of `tls_cert`.")
    driver: str = Field(
        default="auto",
        description="VMM driver: `firecracker`, `qemu-kvm` or `qemu-tcg`; `auto` probes in that "
        "order.",
    )
    default_template: str = Field(
        default="base", description="Built on the first start if missing."
    )
    sandbox_vcpus: int = Field(default=1, description="vCPUs of the default template.")
    sandbox_memory_mb: int = Field(default=512, description="Memory of the default template, MiB.")
    sandbox_disk_mb: int = Field(default=2048, description="Disk of the default template, MiB.")
    max_concurrent_creates: PositiveInt = Field(
        default=8, description="Creates in flight; more wait in a queue instead of failing."
    )
    # Each upload exports and hashes a whole state: unbounded, a restart or a burst of pauses
    # would spend every core on them while users resume.
    max_concurrent_uploads: PositiveInt = Field(
        default=2,
        description="Uploads of pause checkpoints and snapshots to the repository at once; more "
        "wait.",
    )
    max_sandboxes: int = Field(
        default=256,
        description="Sandboxes the node holds, paused ones and creates under way included; "
        "creates and forks past it answer 429.",
    )
    key_max_sandboxes: int = Field(
        default=256,
        description="In a cluster, sandboxes one API key runs at once across all nodes, as the "
        "gateways count them; creates and forks past it answer 429. A node counts per team "
        "(`team_max_sandboxes`).",
    )
    team_max_sandboxes: int = Field(
        default=256,
        description="Sandboxes one team runs at once on the node (paused ones do not count); "
        "creates and forks past it answer 429. On a cluster's gateways: across all nodes.",
    )
    team_creates_per_s: PositiveFloat = Field(
        default=50.0,
        description="Sandbox creates and forks one team may start a second, on average (a "
        "burst of as many at once); past it 429 with `Retry-After`, or, for a create that may "
        "wait (`X-Aenv-Wait`), its turn. On a cluster's gateways: across all of them.",
    )
    team_max_disk_mb: int = Field(
        default=1 << 30,
        description="Disk (MiB) one team's sandboxes (paused ones too) and volumes may take "
        "at their full sizes; a create, fork or volume past it answers 429. On a cluster's "
        "gateways: across all nodes.",
    )
    create_max_wait: NonNegativeFloat = Field(
        default=300.0,
        description="Seconds a create or fork may wait for capacity when its client asks to "
        "(the `X-Aenv-Wait` header); a longer wait asked is cut to this, 0 turns waiting off.",
    )
    create_max_waiters: PositiveInt = Field(
        default=1000,
        description="Creates and fork children waiting for capacity at once; past it, one "
        "asking to wait answers 429 at once.",
    )
    key_requests_per_s: int = Field(
        default=100,
        description="Control-plane requests per API key a second, on average; past it (and "
        "`key_request_burst`) 429 with `Retry-After`.",
    )
    key_request_burst: int = Field(
        default=200,
        description="Control-plane requests per API key at once (see `key_requests_per_s`).",
    )
    reserve_disk_mb: int = Field(
        default=1024,
        description="Free disk (of `home`) the host keeps: under it creates answer 429 and "
        "pauses and snapshots fail, with nothing changed; a create or fork whose sandboxes' "
        "disks (count times disk size, plus the creates starting with it; queued ones hold nothing "
        "yet) do not fit above it answers 429 before anything starts.",
    )
    reserve_memory_mb: int = Field(
        default=256,
        description="Available memory the host keeps: under it creates answer 429 and pauses "
        "and snapshots fail, with nothing changed.",
    )
    admission_sandbox_mb: int = Field(
        default=64,
        description="Admission by memory: a create answers 429 (naming memory) when the host's "
        "available memory minus `reserve_memory_mb` cannot hold this for it and for each create "
        "already under way (a restored guest's own pages, not its nominal RAM); pooled VMs are "
        "given back before a create is refused, running sandboxes never.",
    )
    memory_overcommit: float = Field(
        default=10.0,
        description="Admission by memory: a create answers 429 (naming memory) when the nominal "
        "guest RAM of the running VMs plus its own would pass this times the host's RAM.",
    )
    pool_max: int = Field(
        default=0,
        description="Warm pools: per template, at most this many VMs restored from its current "
        "build and waiting, on slots with no egress, so a create only runs envd `/init` "
        "(identity, env, token, fresh entropy) and gets its egress rules; sized to the "
        "template's creates in the last minute (none after a quiet minute) and refilled one "
        "restore at a time and only once no create has run for a second (a node creating back "
        "to back takes today's path), never into the memory a create needs; never listed or "
        "counted; stopped at shutdown and swept at the next start after a crash. Only built "
        "templates restored from memory are pooled (not snapshots, forks, resized or "
        "volume-mounting sandboxes). 0 (the default) is off: each pooled VM holds about a "
        "running sandbox's host memory and idle CPU.",
    )
    max_timeout: int = Field(
        default=24 * 3600, description="Longest sandbox timeout a client may ask for, in seconds."
    )
    network_prefix: str | None = Field(
        default=None,
        description="Names of network slots (`<prefix>-<n>`: slot namespaces, host interfaces, "
        "the nftables table `inet <prefix>`). Unset: `aenv` for the home `/var/lib/aenv`, else "
        "`aenv` and four hex digits of a hash of the home (`aenv/claims.py`). A node whose "
        "prefix meets a running node's is refused at start.",
    )
    network_cidr: IPv4Network | None = Field(
        default=None,
        description="Host-side addresses of network slots (one /30 a slot). Unset: "
        "`10.200.0.0/16` for the home `/var/lib/aenv`, else a /21 (512 slots) of "
        "`10.200.0.0/13` outside `10.200.0.0/16` that no running node in the same network "
        "namespace holds. A node whose network meets a running node's in its namespace is "
        "refused at start.",
    )
    network_private_allowed: tuple[IPv4Network, ...] = Field(
        default=(),
        description="CIDRs in the private (10/8, 172.16/12, 192.168/16) and CGNAT (100.64/10) "
        "ranges that sandboxes may reach; the rest, link-local (169.254.169.254) and other "
        "sandboxes are never reachable.",
    )
    network_internal: tuple[IPv4Network, ...] = Field(
        default=(),
        description="CIDRs no sandbox may reach whatever its rules (the cluster's own addresses).",
    )
    network_dns: IPv4Address | None = Field(
        default=None,
        description="The resolver that sandboxes with domain rules in `allowOut`, and template "
        "builds, get allowed names from (they get NXDOMAIN for the rest); asked from the host, "
        "so it may be private, link-local or on loopback. Unset: the host's first IPv4 "
        "nameserver, else `1.1.1.1`.",
    )
    network_rules_ca: Path | None = Field(
        default=None,
        description="CA certificates (PEM) that servers of names with header rules "
        "(`network.rules`) may also verify against, besides the host's trust store.",
    )
    secrets_key_file: Path | None = Field(
        default=None,
        description="A file holding the key (32 bytes, base64) that secrets (`/secrets`) are "
        "stored encrypted with; the operator keeps it 0600. Unset: a key generated at the "
        "first start in `$AENV_HOME/secrets.key` (mode 0600). Losing the key loses the secrets' "
        "values.",
    )
    identity_issuer: str | None = Field(
        default=None,
        description="The issuer (`iss`) of sandboxes' workload identity tokens (`iam`): the "
        "URL whose `/.well-known/openid-configuration` a verifier reads, served by the node "
        "and by a cluster's gateways. Unset: `https://<domain>`, or `http://localhost:<port>` "
        "without a domain. The same on every node and gateway of a cluster.",
    )
    warm_slots_low: int = Field(
        default=4,
        description="Warm pool of ready network slots: refilled when it falls under this.",
    )
    warm_slots_high: int = Field(
        default=16, description="Warm pool of ready network slots: refilled up to this."
    )
    pause_on_shutdown: bool = Field(
        default=True,
        description="A graceful stop (SIGTERM/SIGINT) pauses running sandboxes, which are "
        "resumable after the restart; `false` kills them.",
    )
    repository: str = Field(
        default="",
        description="Snapshot repository for durable copies of pauses and snapshots: a "
        "directory (empty: `$AENV_HOME/repository`; relative: under `home`), "
        "`s3://bucket/prefix` (credentials from the usual `AWS_*` environment), or `off`.",
    )
    repository_endpoint: str | None = Field(
        default=None, description="Another S3-speaking server (MinIO, Ceph, moto...) for `s3://`."
    )
    repository_cache_mb: int = Field(
        default=8192,
        description="Node-local cache of repository chunks, MiB (least recently used go).",
    )
    lazy_pulls: bool = Field(
        default=True,
        description="A cluster node resumes a paused sandbox it lacks the files of at once: its "
        "memory and read-only drives are served as the guest reads them and fetched in the "
        "background (`docs/cluster.md`). Off: the whole copy is pulled first.",
    )
    lazy_prefetch: int = Field(
        default=6,
        ge=0,
        le=64,
        description="Chunks a lazily served checkpoint fetches at once ahead of its guest's "
        "reads: those its last lazy resume read, in that order, else its memory file's in file "
        "order (the restore's load faults most of them in, in that order). 0: none ahead; the "
        "rest comes 2 at a time, making way for reads, either way.",
    )
    build_ready_timeout: int = Field(
        default=300, description="Seconds a template build's readyCmd may keep failing."
    )
    build_egress: tuple[str, ...] = Field(
        default=REGISTRIES,
        description="Names (`*.` wildcards too) template builds reach; `debian_mirror`'s host is "
        "added. Empty: builds have no network.",
    )
    build_ca_bundle: Path | None = Field(
        default=Path("/etc/ssl/certs/ca-certificates.crt"),
        description="CA certificates (PEM) that RUN steps trust, so that they reach the "
        "registries as the host does, through a TLS-intercepting proxy too; empty: the image's "
        "own only.",
    )
    build_cache_layers: int = Field(
        default=32,
        description="Cached build steps kept (newest or most recently reused first; each holds "
        "a VM's disks, not its memory).",
    )
    build_log_max_mb: PositiveInt = Field(
        default=8,
        description="Most of a template build's log kept, MiB (on disk; past it the log keeps "
        "its first and last halves, the drop between them said in one entry).",
    )
    publish_code_interpreter: bool = Field(
        default=True,
        description="A node without `code-interpreter-v1` builds it in the background once it "
        "serves (docs/templates.md, Code interpreter); its pip and apt steps need the "
        "registries. `false` leaves that to `aenv template build`.",
    )
    code_interpreter_definition: Path | None = Field(
        default=None,
        description="The template definition `publish_code_interpreter` builds; unset: the "
        "package's `aenv/code_interpreter/template.yaml`.",
    )
    ksm: bool = Field(
        default=False,
        description="Start the host's KSM with this tuning while the node runs (host settings "
        "restored at stop): restored guests' equal pages are merged (docs/density.md). Off by "
        "default: it costs host CPU.",
    )
    ksm_pages_to_scan: int = Field(
        default=1000, description="KSM: pages scanned every `ksm_sleep_ms`."
    )
    ksm_sleep_ms: int = Field(default=20, description="KSM: milliseconds between scans.")
    cold_reclaim_after: int = Field(
        default=0,
        description="Page out VMM memory not accessed for this many seconds to the operator's "
        "swap, through a DAMON kdamond of the node (vaddr, or paddr with memcg filters); 0 is "
        "off. Set, a host without swap, DAMON or a free kdamond slot refuses to start with the "
        "reason (docs/density.md).",
    )
    cold_reclaim_mb_per_s: int = Field(
        default=32, description="Cold reclaim: at most this many MiB paged out a second."
    )
    cold_reclaim_ms_per_s: int = Field(
        default=20, description="Cold reclaim: at most this many ms of the kdamond's time a second."
    )
    hibernate_after: int = Field(
        default=0,
        description="Idle hibernation, in seconds: a running sandbox with no data-plane exchange "
        "(proxy request, envd call, open stream) and no command or PTY running in envd (a "
        "template's start command counts) for that long is paused by the node and woken by its "
        "next request, with its files, processes and memory; the API shows it running "
        "throughout and its timeout keeps counting. A hibernated sandbox holds disk and tmpfs "
        "(its checkpoint), no VMM memory or CPU. 0 (the default) is off: it stops background "
        "processes (a server the sandbox runs, a cron job) until traffic comes "
        "(docs/density.md).",
    )
    events_retention_days: PositiveFloat = Field(
        default=7,
        description="Sandbox lifecycle events (`/events/sandboxes`) are kept this many days.",
    )
    webhook_attempts: PositiveInt = Field(
        default=4,
        description="Attempts of each webhook delivery before it is logged failed (E2B's: the "
        "first and three retries).",
    )
    webhook_retry_delay: PositiveFloat = Field(
        default=10,
        description="Seconds before a webhook delivery's first retry; each later one waits "
        "twice as long. A webhook's deliveries go one at a time, in order, so this holds up "
        "its later ones too.",
    )
    webhook_timeout: PositiveFloat = Field(
        default=10, description="Seconds a webhook receiver has to answer one delivery."
    )
    webhook_queue_limit: PositiveInt = Field(
        default=1000,
        description="Pending deliveries a webhook holds at most; past it, the oldest are "
        "dropped (logged `dropped`), so a dead receiver costs bounded space.",
    )
    webhook_internal_allowed: bool = Field(
        default=False,
        description="Webhooks may target internal addresses: loopback, link-local, private "
        "and CGNAT ranges, other sandboxes, `network_internal`. Off, a webhook reaches only "
        "what a sandbox could (`network_private_allowed` opens parts of the private ranges "
        "to both), so it is no way into the node's network.",
    )
    tcg_tb_mib: PositiveInt = Field(
        default=128,
        description="QEMU under TCG: each VMM's translation cache, MiB (a fresh sandbox uses "
        "22-26, a used one fills it; 48 costs a used sandbox 9-18% more host CPU, 32 slows "
        "commands 3 times: docs/density.md, bench/guest_cpu.py).",
    )
    # At most 16: each is a virtio-mmio device, and microvm has 24.
    share_slots: int = Field(
        default=2,
        description="QEMU: share devices (virtio-9p) of every VM booted, so that sandboxes "
        "restored from its snapshots mount up to this many volumes; unused ones export an empty "
        "read-only directory. 0: only VMMs of sandboxes with volumes serve 9p, and those "
        "sandboxes boot (0-16; docs/volumes.md).",
    )
    volume_size_mb: int = Field(
        default=1024,
        ge=MIN_VOLUME_MB,
        le=MAX_VOLUME_MB,
        description="Size of a volume whose create names no `sizeMB`, MiB: its guests' writes "
        "past it fail with ENOSPC; it is an ext4 image file that takes host disk as it is "
        "written, and creates are refused (507) when the host's free disk above "
        "`reserve_disk_mb` cannot hold it with what existing volumes have not written yet.",
    )
    jail: bool = Field(
        default=True,
        description="Run every VMM jailed (docs/threat-model.md); `false` is for benchmarks and "
        "debugging only.",
    )
    jail_uid_base: PositiveInt | None = Field(
        default=None,
        description="Jailed VMMs: their group; each VMM (QEMU or Firecracker) gets one of the "
        "next `jail_uid_count` uids. Unset: `2000000` for the home `/var/lib/aenv`, else the "
        "first free block of `jail_uid_count + 1` uids after it, from a place a hash of the "
        "home picks, that no running node holds (below 2³¹). A range that meets a running "
        "node's is refused at start.",
    )
    jail_uid_count: PositiveInt = Field(
        default=65_536, description="Jailed VMMs: how many uids after `jail_uid_base` they get."
    )
    guest_cache: Path | None = Field(
        default=None,
        description="Build cache of guest artifacts (kernel, initramfs, base root filesystem, "
        "the envd bundle); unset: `$AENV_HOME/cache/guest`. Nodes may share one, also "
        "read-only (a read-only mount one writable node filled): a node then uses what it "
        "holds, and refuses to start (naming the cache) when it lacks what this version needs.",
    )
    debian_mirror: str = Field(
        default=DEFAULT_MIRROR,
        description="Debian mirror the base root filesystem is bootstrapped from.",
    )
    header_timeout: int = Field(
        default=30,
        description="Seconds a client has to send a request's line and headers; a slower one "
        "(slowloris) is disconnected.",
    )
    max_connections: int = Field(
        default=4096,
        description="Open client connections on the port; past it new ones are closed at once.",
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        description="Largest request head (line and headers); a bigger one is answered 431.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Cluster: the Redis (or Valkey) holding the cluster's state, required by "
        "`aenv node`, `aenv gateway` and `aenv nodes` (`aenv server` reads none of the cluster "
        "settings and never connects to Redis): `redis://`, `rediss://` (TLS) or `unix://`; a "
        "password goes in the URL.",
    )
    node_id: str | None = Field(
        default=None,
        description="Cluster: this node's id, unique in the cluster; unset: the host name.",
    )
    node_address: str | None = Field(
        default=None,
        description="Cluster: the address gateways reach this node at; unset: host:port.",
    )
    cluster_secret: str | None = Field(
        default=None,
        description="Cluster: the secret its nodes and gateways share (required; at least 16 "
        "characters; in the configuration file or the environment only, never a flag); "
        "gateways call nodes with a token derived from it.",
    )
    heartbeat_interval: float = Field(
        default=5.0, description="Cluster: seconds between a node's heartbeats."
    )
    lease_ttl: float = Field(
        default=15.0, description="Cluster: seconds a node's lease outlives its last heartbeat."
    )

    @field_validator(
        "domain", "repository_endpoint", "guest_cache", "tls_cert", "tls_key", "redis_url",
        "node_id", "node_address", "cluster_secret", "network_dns", "build_ca_bundle",
        "network_rules_ca", "secrets_key_file", "identity_issuer",
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
