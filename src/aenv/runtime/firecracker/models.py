"""Typed bodies of the Firecracker REST API (swagger 1.17) that AENV sends and reads.

One pydantic model per swagger definition we use, with the swagger's field names, so a model
dumps straight to the JSON Firecracker expects. Request models forbid unknown fields because
Firecracker does too (`deny_unknown_fields`): a typo fails here, not inside the VMM. Response
models ignore unknown fields so a newer Firecracker that adds fields still parses.

Not modelled, because AENV does not use them: pmem, memory hotplug, vhost-user block drives,
CPU configuration templates (the `cpu_template` field of the machine config is), and the
deprecated `mem_file_path` / `enable_diff_snapshots` / `vsock_id` fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Request(BaseModel):
    """A request body: `body()` is what goes on the wire (unset optional fields are omitted, so
    Firecracker applies its own defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class Response(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


# Firecracker accepts only these device ids (its `checked_id`); they also appear in URL paths.
DEVICE_ID_PATTERN = r"^[A-Za-z0-9_]+$"


# --- rate limiting -------------------------------------------------------------------------------


class TokenBucket(Request):
    """`size` tokens refilled every `refill_time` ms; `one_time_burst` extra tokens at start."""

    size: int = Field(ge=0)
    refill_time: int = Field(ge=0)
    one_time_burst: int | None = Field(default=None, ge=0)


class RateLimiter(Request):
    """Independent limits on bytes (`bandwidth`) and operations (`ops`) per second."""

    bandwidth: TokenBucket | None = None
    ops: TokenBucket | None = None


# --- pre-boot configuration ----------------------------------------------------------------------

CpuTemplate = Literal["C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"]
HugePages = Literal["None", "Transparent", "2M"]


class MachineConfiguration(Request):
    vcpu_count: int = Field(ge=1, le=32)
    mem_size_mib: int = Field(ge=1)
    smt: bool | None = None
    # Needed for diff snapshots that hold exactly the pages written since the last snapshot.
    track_dirty_pages: bool | None = None
    huge_pages: HugePages | None = None
    cpu_template: CpuTemplate | None = None


class BootSource(Request):
    kernel_image_path: str
    boot_args: str | None = None
    initrd_path: str | None = None


CacheType = Literal["Unsafe", "Writeback"]
IoEngine = Literal["Sync", "Async"]


class Drive(Request):
    """A virtio-block drive backed by a host file."""

    drive_id: str = Field(pattern=DEVICE_ID_PATTERN)
    is_root_device: bool
    path_on_host: str
    is_read_only: bool
    partuuid: str | None = None
    cache_type: CacheType | None = None
    io_engine: IoEngine | None = None
    rate_limiter: RateLimiter | None = None


class PartialDrive(Request):
    """Post-boot drive update: swap the backing file or change the rate limiter."""

    drive_id: str = Field(pattern=DEVICE_ID_PATTERN)
    path_on_host: str | None = None
    rate_limiter: RateLimiter | None = None


class NetworkInterface(Request):
    iface_id: str = Field(pattern=DEVICE_ID_PATTERN)
    host_dev_name: str = Field(min_length=1)
    guest_mac: str | None = None
    mtu: int | None = Field(default=None, ge=68, le=65535)
    rx_rate_limiter: RateLimiter | None = None
    tx_rate_limiter: RateLimiter | None = None


class PartialNetworkInterface(Request):
    iface_id: str = Field(pattern=DEVICE_ID_PATTERN)
    rx_rate_limiter: RateLimiter | None = None
    tx_rate_limiter: RateLimiter | None = None


class Vsock(Request):
    """Host side of virtio-vsock: Firecracker listens on `uds_path` for host-initiated
    connections and connects to `<uds_path>_<port>` for guest-initiated ones."""

    guest_cid: int = Field(ge=3)
    uds_path: str


class Balloon(Request):
    amount_mib: int = Field(ge=0)
    deflate_on_oom: bool
    stats_polling_interval_s: int | None = Field(default=None, ge=0)
    free_page_hinting: bool | None = None
    # The guest hands freed pages back to the host, which is what makes idle sandboxes cheap.
    free_page_reporting: bool | None = None


class BalloonUpdate(Request):
    amount_mib: int = Field(ge=0)


class BalloonStatsUpdate(Request):
    stats_polling_interval_s: int = Field(ge=0)


class BalloonStartCmd(Request):
    acknowledge_on_stop: bool | None = None


class EntropyDevice(Request):
    """virtio-rng: lets the guest draw host entropy (clones must reseed after a restore)."""

    rate_limiter: RateLimiter | None = None


MmdsVersion = Literal["V1", "V2"]


class MmdsConfig(Request):
    network_interfaces: list[str] = Field(min_length=1)
    version: MmdsVersion | None = None
    ipv4_address: str | None = None
    imds_compat: bool | None = None


LogLevel = Literal["Error", "Warning", "Info", "Debug", "Trace", "Off"]


class Logger(Request):
    log_path: str | None = None
    level: LogLevel | None = None
    show_level: bool | None = None
    show_log_origin: bool | None = None
    module: str | None = None


class Metrics(Request):
    metrics_path: str
    emit_id: bool | None = None
    properties: dict[str, str] | None = None


class SerialDevice(Request):
    serial_out_path: str | None = None
    rate_limiter: TokenBucket | None = None


# --- actions and runtime state -------------------------------------------------------------------

ActionType = Literal["InstanceStart", "FlushMetrics", "SendCtrlAltDel"]


class InstanceActionInfo(Request):
    action_type: ActionType


class Vm(Request):
    state: Literal["Paused", "Resumed"]


# --- snapshots -----------------------------------------------------------------------------------

SnapshotType = Literal["Full", "Diff"]


class SnapshotCreateParams(Request):
    snapshot_path: str
    mem_file_path: str
    snapshot_type: SnapshotType | None = None


class MemoryBackend(Request):
    """`File`: Firecracker maps `backend_path` MAP_PRIVATE, so clean pages stay shared through
    the host page cache and guest writes go to private anonymous memory. `Uffd`: a page-fault
    handler listening on the unix socket `backend_path` serves the memory."""

    backend_type: Literal["File", "Uffd"]
    backend_path: str


class NetworkOverride(Request):
    iface_id: str = Field(pattern=DEVICE_ID_PATTERN)
    host_dev_name: str


class VsockOverride(Request):
    uds_path: str


class SnapshotLoadParams(Request):
    snapshot_path: str
    mem_backend: MemoryBackend
    track_dirty_pages: bool | None = None
    resume_vm: bool | None = None
    network_overrides: list[NetworkOverride] | None = None
    vsock_override: VsockOverride | None = None
    clock_realtime: bool | None = None
    huge_pages: Literal["Snapshot", "None", "Transparent", "2M"] | None = None


# --- responses -----------------------------------------------------------------------------------


class InstanceInfo(Response):
    app_name: str
    id: str
    state: Literal["Not started", "Running", "Paused"]
    vmm_version: str


class FirecrackerVersion(Response):
    firecracker_version: str


class BalloonConfig(Response):
    amount_mib: int
    deflate_on_oom: bool
    stats_polling_interval_s: int = 0
    free_page_hinting: bool = False
    free_page_reporting: bool = False


class BalloonStats(Response):
    """Guest memory statistics from the balloon driver; the optional ones are absent until the
    guest has reported them."""

    target_pages: int
    actual_pages: int
    target_mib: int
    actual_mib: int
    swap_in: int | None = None
    swap_out: int | None = None
    major_faults: int | None = None
    minor_faults: int | None = None
    free_memory: int | None = None
    total_memory: int | None = None
    available_memory: int | None = None
    disk_caches: int | None = None
    hugetlb_allocations: int | None = None
    hugetlb_failures: int | None = None
    oom_kill: int | None = None
    alloc_stall: int | None = None
    async_scan: int | None = None
    direct_scan: int | None = None
    async_reclaim: int | None = None
    direct_reclaim: int | None = None


class BalloonHintingStatus(Response):
    host_cmd: int
    guest_cmd: int | None = None
