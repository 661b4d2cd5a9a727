"""envd's runtime settings: what the host configures at start and through `POST /init`."""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _default_user() -> str:
    # E2B templates run commands as `user`; a bare image without that account falls back to root.
    try:
        pwd.getpwnam("user")
    except KeyError:
        return "root"
    return "user"


@dataclass(slots=True)
class Settings:
    """Mutable by `/init`; read by every request."""

    access_token: str | None = None
    default_user: str = field(default_factory=_default_user)
    default_workdir: str | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    # Seconds a finished process stays connectable (infra: terminatedRetentionTTL).
    process_retention: float = 30.0
    # Largest accepted upload body, in bytes; None is unbounded.
    max_upload_bytes: int | None = None

    def process_base_env(self) -> dict[str, str]:
        """Sandbox-wide variables every process gets (before per-request envs)."""
        return {"PATH": os.environ.get("PATH", DEFAULT_PATH), **self.env_vars}
