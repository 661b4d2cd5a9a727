"""Every request body our models produce validates against Firecracker's swagger, and the
validator really catches wrong bodies (so a passing validation means something)."""

from __future__ import annotations

import inspect
from typing import Any

import jsonschema
import pydantic
import pytest

from aenv.runtime.firecracker import models as m
from tests.runtime.firecracker.fc_swagger import Swagger

LIMIT = m.RateLimiter(
    bandwidth=m.TokenBucket(size=50 << 20, refill_time=1000, one_time_burst=100 << 20),
    ops=m.TokenBucket(size=2000, refill_time=1000),
)

# (swagger definition, body) for every request model, minimal and fully populated.
SAMPLES: list[tuple[str, m.Request]] = [
    ("TokenBucket", m.TokenBucket(size=1, refill_time=0)),
    ("TokenBucket", m.TokenBucket(size=1, refill_time=0, one_time_burst=10)),
    ("RateLimiter", m.RateLimiter()),
    ("RateLimiter", LIMIT),
    ("MachineConfiguration", m.MachineConfiguration(vcpu_count=1, mem_size_mib=128)),
    (
        "MachineConfiguration",
        m.MachineConfiguration(
            vcpu_count=2,
            mem_size_mib=1024,
            smt=False,
            track_dirty_pages=True,
            huge_pages="None",
            cpu_template="T2S",
        ),
    ),
    ("BootSource", m.BootSource(kernel_image_path="vmlinux")),
    (
        "BootSource",
        m.BootSource(
            kernel_image_path="/k/vmlinux", boot_args="console=ttyS0", initrd_path="/k/initrd"
        ),
    ),
    (
        "Drive",
        m.Drive(drive_id="rootfs", is_root_device=False, path_on_host="d", is_read_only=True),
    ),
    (
        "Drive",
        m.Drive(
            drive_id="upper",
            is_root_device=False,
            path_on_host="drives/upper",
            is_read_only=False,
            partuuid="0eaa91a0-01",
            cache_type="Writeback",
            io_engine="Async",
            rate_limiter=LIMIT,
        ),
    ),
    ("PartialDrive", m.PartialDrive(drive_id="upper")),
    ("PartialDrive", m.PartialDrive(drive_id="upper", path_on_host="x", rate_limiter=LIMIT)),
    ("NetworkInterface", m.NetworkInterface(iface_id="eth0", host_dev_name="tap0")),
    (
        "NetworkInterface",
        m.NetworkInterface(
            iface_id="eth0",
            host_dev_name="tap0",
            guest_mac="02:fc:00:00:00:01",
            mtu=1500,
            rx_rate_limiter=LIMIT,
            tx_rate_limiter=LIMIT,
        ),
    ),
    ("PartialNetworkInterface", m.PartialNetworkInterface(iface_id="eth0")),
    (
        "PartialNetworkInterface",
        m.PartialNetworkInterface(iface_id="eth0", rx_rate_limiter=LIMIT, tx_rate_limiter=LIMIT),
    ),
    ("Vsock", m.Vsock(guest_cid=3, uds_path="vsock.sock")),
    ("Balloon", m.Balloon(amount_mib=0, deflate_on_oom=True)),
    (
        "Balloon",
        m.Balloon(
            amount_mib=0,
            deflate_on_oom=True,
            stats_polling_interval_s=1,
            free_page_hinting=False,
            free_page_reporting=True,
        ),
    ),
    ("BalloonUpdate", m.BalloonUpdate(amount_mib=64)),
    ("BalloonStatsUpdate", m.BalloonStatsUpdate(stats_polling_interval_s=5)),
    ("BalloonStartCmd", m.BalloonStartCmd()),
    ("BalloonStartCmd", m.BalloonStartCmd(acknowledge_on_stop=True)),
    ("EntropyDevice", m.EntropyDevice()),
    ("EntropyDevice", m.EntropyDevice(rate_limiter=LIMIT)),
    ("MmdsConfig", m.MmdsConfig(network_interfaces=["eth0"])),
    (
        "MmdsConfig",
        m.MmdsConfig(
            network_interfaces=["eth0"],
            version="V2",
            ipv4_address="169.254.169.254",
            imds_compat=False,
        ),
    ),
    ("Logger", m.Logger()),
    (
        "Logger",
        m.Logger(
            log_path="fc.log", level="Warning", show_level=True, show_log_origin=True, module="vmm"
        ),
    ),
    ("Metrics", m.Metrics(metrics_path="metrics.ndjson")),
    ("Metrics", m.Metrics(metrics_path="m", emit_id=True, properties={"sandbox": "abc"})),
    ("SerialDevice", m.SerialDevice()),
    (
        "SerialDevice",
        m.SerialDevice(
            serial_out_path="console.log", rate_limiter=m.TokenBucket(size=1, refill_time=1)
        ),
    ),
    ("InstanceActionInfo", m.InstanceActionInfo(action_type="InstanceStart")),
    ("InstanceActionInfo", m.InstanceActionInfo(action_type="FlushMetrics")),
    ("InstanceActionInfo", m.InstanceActionInfo(action_type="SendCtrlAltDel")),
    ("Vm", m.Vm(state="Paused")),
    ("Vm", m.Vm(state="Resumed")),
    ("SnapshotCreateParams", m.SnapshotCreateParams(snapshot_path="s", mem_file_path="m")),
    (
        "SnapshotCreateParams",
        m.SnapshotCreateParams(snapshot_path="s", mem_file_path="m", snapshot_type="Diff"),
    ),
    ("MemoryBackend", m.MemoryBackend(backend_type="File", backend_path="mem")),
    ("NetworkOverride", m.NetworkOverride(iface_id="eth0", host_dev_name="tap1")),
    ("VsockOverride", m.VsockOverride(uds_path="v.sock")),
    (
        "SnapshotLoadParams",
        m.SnapshotLoadParams(
            snapshot_path="state",
            mem_backend=m.MemoryBackend(backend_type="File", backend_path="m"),
        ),
    ),
    (
        "SnapshotLoadParams",
        m.SnapshotLoadParams(
            snapshot_path="state",
            mem_backend=m.MemoryBackend(backend_type="Uffd", backend_path="uffd.sock"),
            track_dirty_pages=True,
            resume_vm=False,
            network_overrides=[m.NetworkOverride(iface_id="eth0", host_dev_name="tap0")],
            vsock_override=m.VsockOverride(uds_path="vsock.sock"),
            clock_realtime=True,
            huge_pages="Snapshot",
        ),
    ),
]


def _request_models() -> list[type[m.Request]]:
    return [
        cls
        for _, cls in inspect.getmembers(m, inspect.isclass)
        if issubclass(cls, m.Request) and cls is not m.Request
    ]


@pytest.mark.parametrize(
    ("definition", "model"), SAMPLES, ids=[f"{d}-{i}" for i, (d, _) in enumerate(SAMPLES)]
)
def test_body_validates_against_swagger(
    swagger: Swagger, definition: str, model: m.Request
) -> None:
    swagger.validate(definition, model.body())


def test_every_request_model_is_sampled_fully() -> None:
    """Each model appears in SAMPLES with every one of its fields set at least once."""
    for cls in _request_models():
        bodies = [model.body() for _, model in SAMPLES if type(model) is cls]
        assert bodies, f"{cls.__name__} has no sample"
        seen = set().union(*bodies)
        assert seen == set(cls.model_fields), f"{cls.__name__} fields never sampled"


def test_models_mirror_swagger_definitions(swagger: Swagger) -> None:
    """Same name, only swagger properties, and every swagger-required property required here."""
    for cls in _request_models():
        definition = swagger.raw["definitions"][cls.__name__]
        properties = set(definition.get("properties", {}))
        assert set(cls.model_fields) <= properties, cls.__name__
        for name in definition.get("required", []):
            assert cls.model_fields[name].is_required(), f"{cls.__name__}.{name}"


WRONG_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("MachineConfiguration", {"vcpu_count": 2}),  # mem_size_mib missing
    ("MachineConfiguration", {"vcpu_count": 64, "mem_size_mib": 128}),  # above 32
    ("MachineConfiguration", {"vcpu_count": 1, "mem_size_mib": "128"}),  # wrong type
    ("MachineConfiguration", {"vcpu_count": 1, "mem_size_mib": 128, "track_dirty": True}),
    ("BootSource", {"boot_args": "console=ttyS0"}),
    ("Drive", {"drive_id": "root", "path_on_host": "x", "is_read_only": True}),
    ("Drive", {"drive_id": "r", "is_root_device": False, "io_engine": "Uring"}),
    ("Drive", {"drive_id": "r", "is_root_device": False, "read_only": True}),
    ("TokenBucket", {"size": -1, "refill_time": 100}),
    ("RateLimiter", {"bandwidth": {"size": 1}}),
    ("NetworkInterface", {"iface_id": "eth0", "host_dev_name": "tap0", "mtu": 40}),
    ("Vsock", {"guest_cid": 2, "uds_path": "v"}),
    ("Balloon", {"amount_mib": 0}),
    ("MmdsConfig", {"version": "V2"}),
    ("Logger", {"level": "Verbose"}),
    ("InstanceActionInfo", {"action_type": "InstanceStop"}),
    ("Vm", {"state": "Running"}),
    ("SnapshotCreateParams", {"snapshot_path": "s", "mem_file_path": "m", "snapshot_type": "Inc"}),
    ("SnapshotCreateParams", {"snapshot_path": "s"}),
    ("SnapshotLoadParams", {"snapshot_path": "s", "mem_backend": {"backend_type": "File"}}),
    ("SnapshotLoadParams", {"snapshot_path": "s", "network_overrides": [{"iface_id": "eth0"}]}),
    ("SnapshotLoadParams", {"snapshot_path": "s", "drive_overrides": []}),
]


@pytest.mark.parametrize(
    ("definition", "body"), WRONG_BODIES, ids=[f"{d}-{i}" for i, (d, _) in enumerate(WRONG_BODIES)]
)
def test_validator_rejects_wrong_body(swagger: Swagger, definition: str, body: Any) -> None:
    with pytest.raises(jsonschema.ValidationError):
        swagger.validate(definition, body)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (m.MachineConfiguration, {"vcpu_count": 0, "mem_size_mib": 128}),
        (m.MachineConfiguration, {"vcpu_count": 1, "mem_size_mib": 128, "track_dirty": True}),
        (m.Vm, {"state": "Running"}),
        (m.TokenBucket, {"size": -1, "refill_time": 1}),
        (m.Vsock, {"guest_cid": 2, "uds_path": "v"}),
        (
            m.SnapshotCreateParams,
            {"snapshot_path": "s", "mem_file_path": "m", "snapshot_type": "X"},
        ),
    ],
)
def test_models_refuse_what_the_swagger_refuses(cls: type[m.Request], kwargs: Any) -> None:
    with pytest.raises(pydantic.ValidationError):
        cls(**kwargs)


def test_unset_optionals_are_omitted_so_firecracker_defaults_apply() -> None:
    assert m.MachineConfiguration(vcpu_count=1, mem_size_mib=128).body() == {
        "vcpu_count": 1,
        "mem_size_mib": 128,
    }


@pytest.mark.parametrize(
    ("cls", "definition", "body"),
    [
        (
            m.InstanceInfo,
            "InstanceInfo",
            {"app_name": "Firecracker", "id": "a", "state": "Paused", "vmm_version": "1.17.0"},
        ),
        (m.FirecrackerVersion, "FirecrackerVersion", {"firecracker_version": "1.17.0"}),
        (
            m.BalloonConfig,
            "Balloon",
            {"amount_mib": 0, "deflate_on_oom": True, "free_page_reporting": True},
        ),
        (
            m.BalloonStats,
            "BalloonStats",
            {
                "target_pages": 0,
                "actual_pages": 0,
                "target_mib": 0,
                "actual_mib": 0,
                "free_memory": 5,
                "oom_kill": 0,
            },
        ),
        (m.BalloonHintingStatus, "BalloonHintingStatus", {"host_cmd": 1, "guest_cmd": 2}),
    ],
)
def test_response_models_read_swagger_valid_answers(
    swagger: Swagger, cls: type[m.Response], definition: str, body: dict[str, Any]
) -> None:
    swagger.validate(definition, body)
    parsed = cls.model_validate(body)
    assert parsed.model_dump(exclude_unset=True) == body
