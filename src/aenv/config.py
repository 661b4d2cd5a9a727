"""Server configuration: defaults that work on one machine, a TOML file, `AENV_*` env vars.

Precedence: defaults < `$AENV_HOME/config.toml` (or `AENV_CONFIG`) < environment < explicit
overrides (CLI flags). Every key is a field of `Config`; env names are `AENV_` + the key in
upper case (`AENV_PORT=3001`).
"""

from __future__ import annotations

import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_HOME = Path("/var/lib/aenv")


class ConfigError(ValueError):
    """A configuration value that cannot be used."""


@dataclass(frozen=True)
class Config:
    home: Path = DEFAULT_HOME
    host: str = "0.0.0.0"  # noqa: S104 - a server meant to be reached
    port: int = 3000
    # Public base domain for sandbox URLs (`{port}-{id}.{domain}`); None lets SDKs use theirs.
    domain: str | None = None
    # VMM driver: auto | firecracker | qemu-kvm | qemu-tcg.
    driver: str = "auto"
    default_template: str = "base"
    sandbox_vcpus: int = 1
    sandbox_memory_mb: int = 512
    sandbox_disk_mb: int = 2048
    # Creates running at once; more wait in a queue instead of failing.
    max_concurrent_creates: int = 8
    max_sandboxes: int = 256
    # Longest timeout a client may ask for, in seconds.
    max_timeout: int = 24 * 3600
    network_prefix: str = "aenv"
    network_cidr: str = "10.200.0.0/16"
    # Comma-separated CIDRs. Sandboxes never reach private (10/8, 172.16/12, 192.168/16) or
    # CGNAT (100.64/10) addresses, except those in `network_private_allowed`, nor any in
    # `network_internal` (the cluster's own addresses, say).
    network_private_allowed: str = ""
    network_internal: str = ""
    # The resolver that sandboxes with domain rules get the addresses of allowed names from.
    network_dns: str = "1.1.1.1"
    warm_slots_low: int = 4
    warm_slots_high: int = 16
    # Graceful shutdown pauses running sandboxes (they are resumable after the restart);
    # off, it kills them.
    pause_on_shutdown: bool = True
    # The snapshot repository holding durable copies of pauses and snapshots: a directory
    # (default: `$AENV_HOME/repository`), `s3://bucket[/prefix]` (credentials from the usual
    # AWS environment), or `off`. `repository_endpoint` points S3 at another S3-speaking server.
    repository: str = ""
    repository_endpoint: str | None = None
    # Node-local cache of repository chunks, in MiB (least recently used chunks are evicted).
    repository_cache_mb: int = 8192
    # Template builds: how long a build's readyCmd may keep failing before the build fails.
    build_ready_timeout: int = 300
    # Template builds: cached step layers kept (newest first); each holds a VM's memory and disk.
    build_cache_layers: int = 32

    @property
    def catalog_path(self) -> Path:
        return self.home / "catalog.db"

    @property
    def api_key_path(self) -> Path:
        return self.home / "api-key"

    @property
    def templates_dir(self) -> Path:
        return self.home / "templates"

    @property
    def sandboxes_dir(self) -> Path:
        return self.home / "sandboxes"


def _coerce(name: str, raw: Any, kind: Any) -> Any:
    if not isinstance(raw, str):
        return Path(raw) if kind is Path else raw  # TOML already typed it
    try:
        if kind is int:
            return int(raw)
        if kind is Path:
            return Path(raw)
    except ValueError as e:
        raise ConfigError(f"{name}: cannot use {raw!r}: {e}") from e
    if kind == (str | None):
        return raw or None
    return raw


def load(
    overrides: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """The effective configuration (raises ConfigError on unknown keys or unusable values)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    home = Path(env.get("AENV_HOME", str(DEFAULT_HOME)))
    config_file = Path(env.get("AENV_CONFIG", str(home / "config.toml")))
    if config_file.is_file():
        try:
            values.update(tomllib.loads(config_file.read_text()))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{config_file}: {e}") from e
    kinds = typing.get_type_hints(Config)
    for name in kinds:
        if f"AENV_{name.upper()}" in env:
            values[name] = env[f"AENV_{name.upper()}"]
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise ConfigError(f"unknown configuration keys: {', '.join(unknown)}")
    return Config(**{name: _coerce(name, value, kinds[name]) for name, value in values.items()})
