"""Request bodies of the E2B control plane, validated at the HTTP edge.

Field names are the SDKs' JSON keys. Unknown keys are accepted and ignored (newer SDKs send
options this node does not implement yet; rejecting them would break those clients).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_TIMEOUT_V1 = 15
DEFAULT_TIMEOUT_V2 = 300


class _Body(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NetworkConfig(_Body):
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: list[str] | None = Field(default=None, alias="allowOut")
    deny_out: list[str] | None = Field(default=None, alias="denyOut")


class NewSandbox(_Body):
    """`POST /sandboxes` (v1) and `POST /v2/sandboxes`; only the default timeout differs."""

    template_id: str = Field(alias="templateID", min_length=1)
    timeout: int | None = Field(default=None, ge=0)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    auto_pause: bool = Field(default=False, alias="autoPause")
    secure: bool | None = None
    allow_internet_access: bool | None = None
    network: NetworkConfig | None = None


class TimeoutBody(_Body):
    timeout: int = Field(ge=0)


class ConnectBody(_Body):
    timeout: int | None = Field(default=None, ge=0)


class RefreshBody(_Body):
    duration: int | None = Field(default=None, ge=0)
