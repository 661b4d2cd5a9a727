"""Request bodies of the E2B control plane, validated at the HTTP edge.

Field names are the SDKs' JSON keys. Unknown keys are accepted and ignored (newer SDKs send
options this node does not implement yet; rejecting them would break those clients).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TIMEOUT_V1 = 15
DEFAULT_TIMEOUT_V2 = 300
MAX_FORK = 100


class _Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NetworkConfig(_Body):
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")


class AutoResume(_Body):
    enabled: bool = False


class NewSandbox(_Body):
    """`POST /sandboxes` (v1) and `POST /v2/sandboxes`; only the default timeout differs."""

    template_id: str = Field(alias="templateID", min_length=1)
    timeout: int | None = Field(default=None, ge=0)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    auto_pause: bool = Field(default=False, alias="autoPause")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None


class TimeoutBody(_Body):
    timeout: int = Field(ge=0)


class ConnectBody(_Body):
    timeout: int | None = Field(default=None, ge=0)
    # False: cold-boot from the disks, ignoring the memory snapshot (`on_resume="reboot"`).
    memory: bool = True


class ResumeBody(_Body):
    """`POST /sandboxes/{id}/resume` (SDKs 2.0-2.19)."""

    timeout: int | None = Field(default=None, ge=0)
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
    timeout: int | None = Field(default=None, ge=1)
    count: int = Field(default=1, ge=1, le=MAX_FORK)


class RefreshBody(_Body):
    duration: int | None = Field(default=None, ge=0)
