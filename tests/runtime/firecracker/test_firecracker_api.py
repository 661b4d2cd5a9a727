"""The API client against a real HTTP server on a unix socket that answers like Firecracker
(`fc_peer`): routes and bodies are checked against the swagger by the peer, and Firecracker's
error answers become `FirecrackerApiError`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pydantic
import pytest

from aenv.runtime.firecracker import models as m
from aenv.runtime.firecracker.api import (
    FirecrackerApi,
    FirecrackerApiError,
    FirecrackerConnectionError,
    FirecrackerError,
)
from tests.runtime.firecracker.fc_peer import PeerState
from tests.runtime.firecracker.fc_swagger import Swagger

LIMIT = m.RateLimiter(bandwidth=m.TokenBucket(size=1 << 20, refill_time=100))


async def test_boot_sequence_reaches_firecracker_as_swagger_valid_requests(
    peer: PeerState, swagger: Swagger, tmp_path: Path
) -> None:
    (tmp_path / "rootfs.ext4").touch()
    (tmp_path / "vmlinux").touch()
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        assert (await api.describe_instance()).state == "Not started"
        assert (await api.version()).firecracker_version == "1.17.0"
        await api.put_logger(m.Logger(log_path="fc.log", level="Warning"))
        await api.put_metrics(m.Metrics(metrics_path="metrics.ndjson"))
        await api.put_machine_config(
            m.MachineConfiguration(vcpu_count=2, mem_size_mib=256, track_dirty_pages=True)
        )
        await api.put_boot_source(m.BootSource(kernel_image_path="vmlinux", boot_args="quiet"))
        await api.put_drive(
            m.Drive(
                drive_id="rootfs",
                is_root_device=False,
                path_on_host="rootfs.ext4",
                is_read_only=True,
                rate_limiter=LIMIT,
            )
        )
        await api.put_network_interface(
            m.NetworkInterface(iface_id="eth0", host_dev_name="tap0", guest_mac="02:00:00:00:00:01")
        )
        await api.put_vsock(m.Vsock(guest_cid=3, uds_path="vsock.sock"))
        await api.put_balloon(
            m.Balloon(
                amount_mib=0,
                deflate_on_oom=True,
                stats_polling_interval_s=1,
                free_page_reporting=True,
            )
        )
        await api.put_entropy(m.EntropyDevice())
        await api.put_serial(m.SerialDevice(serial_out_path="console.log"))
        await api.put_mmds_config(m.MmdsConfig(network_interfaces=["eth0"], version="V2"))
        await api.start()
        assert (await api.describe_instance()).state == "Running"

        await api.patch_drive(m.PartialDrive(drive_id="rootfs", rate_limiter=LIMIT))
        await api.patch_network_interface(
            m.PartialNetworkInterface(iface_id="eth0", tx_rate_limiter=LIMIT)
        )
        await api.put_mmds({"sandbox": {"id": "abc"}})
        await api.patch_mmds({"sandbox": {"id": "def"}, "x": 1})
        assert await api.get_mmds() == {"sandbox": {"id": "def"}, "x": 1}
        assert (await api.describe_balloon()).free_page_reporting is True
        await api.patch_balloon(m.BalloonUpdate(amount_mib=64))
        await api.patch_balloon_stats_interval(m.BalloonStatsUpdate(stats_polling_interval_s=2))
        stats = await api.balloon_stats()
        assert (stats.target_mib, stats.total_memory) == (64, 256 << 20)
        await api.start_balloon_hinting(m.BalloonStartCmd(acknowledge_on_stop=True))
        assert (await api.balloon_hinting_status()).host_cmd == 0
        await api.stop_balloon_hinting()
        await api.flush_metrics()
        await api.send_ctrl_alt_del()

        await api.pause()
        assert (await api.describe_instance()).state == "Paused"
        await api.create_snapshot(
            m.SnapshotCreateParams(snapshot_path="state", mem_file_path="mem", snapshot_type="Diff")
        )
        await api.resume()
        assert (await api.describe_instance()).state == "Running"

    assert (tmp_path / "state").is_file() and (tmp_path / "mem").is_file()
    # Belt and braces: the peer refused invalid bodies already; check what it recorded too.
    for request in peer.requests:
        found = swagger.operation(request.method, request.path)
        assert found is not None, (request.method, request.path)
        op, _ = found
        if op.body_definition and request.body is not None:
            swagger.validate(op.body_definition, request.body)
    assert peer.bodies("PUT", "/drives/rootfs")[0]["rate_limiter"] == LIMIT.body()
    assert peer.bodies("PATCH", "/vm") == [{"state": "Paused"}, {"state": "Resumed"}]


async def test_snapshot_load_round_trip(peer: PeerState, tmp_path: Path) -> None:
    (tmp_path / "vmlinux").touch()
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        await api.put_machine_config(m.MachineConfiguration(vcpu_count=1, mem_size_mib=1))
        await api.put_boot_source(m.BootSource(kernel_image_path="vmlinux"))
        await api.put_network_interface(m.NetworkInterface(iface_id="eth0", host_dev_name="tap0"))
        await api.start()
        await api.pause()
        await api.create_snapshot(m.SnapshotCreateParams(snapshot_path="s", mem_file_path="m"))

    # A fresh process: the peer forgets everything but the files, as a new Firecracker would.
    peer.state, peer.config, peer.requests = "Not started", {}, []
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        await api.load_snapshot(
            m.SnapshotLoadParams(
                snapshot_path="s",
                mem_backend=m.MemoryBackend(backend_type="File", backend_path="m"),
                track_dirty_pages=True,
                network_overrides=[m.NetworkOverride(iface_id="eth0", host_dev_name="tap7")],
            )
        )
        assert (await api.describe_instance()).state == "Paused"
        await api.resume()
    assert peer.config["network-interfaces"]["eth0"]["host_dev_name"] == "tap7"


async def test_fault_message_becomes_a_clear_exception(peer: PeerState, tmp_path: Path) -> None:
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerApiError) as caught:
            await api.pause()  # not started yet: Firecracker refuses with a fault_message
        err = caught.value
        assert (err.method, err.path, err.status) == ("PATCH", "/vm", 400)
        assert "not supported before starting" in err.fault_message
        assert "PATCH /vm -> 400" in str(err)

        peer.fail[("PUT", "/snapshot/load")] = (400, "Load snapshot error: bad CRC")
        with pytest.raises(FirecrackerApiError, match="bad CRC"):
            await api.load_snapshot(
                m.SnapshotLoadParams(
                    snapshot_path="s",
                    mem_backend=m.MemoryBackend(backend_type="File", backend_path="m"),
                )
            )


async def test_path_ids_follow_firecrackers_rules(peer: PeerState, tmp_path: Path) -> None:
    (tmp_path / "d").touch()
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerApiError, match="does not match"):
            await api._call("PUT", "/drives/other", {"drive_id": "x", "is_root_device": False})
        with pytest.raises(FirecrackerApiError, match="alphanumeric"):
            await api._call("PUT", "/drives/a-b", {"drive_id": "a-b", "is_root_device": False})
        await api.put_drive(
            m.Drive(drive_id="a_B1", is_root_device=False, path_on_host="d", is_read_only=True)
        )
    assert peer.requests[-1].path == "/drives/a_B1"
    # The model refuses what Firecracker would, before anything is sent.
    for bad in ("a-b", "a b", "", "x/y", "abc\n"):
        with pytest.raises(pydantic.ValidationError):
            m.Drive(drive_id=bad, is_root_device=False, path_on_host="d", is_read_only=True)
        with pytest.raises(pydantic.ValidationError):
            m.NetworkInterface(iface_id=bad, host_dev_name="tap0")


async def test_unknown_route_is_refused_like_firecracker(peer: PeerState, tmp_path: Path) -> None:
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerApiError, match="Invalid request method and/or path"):
            await api._call("GET", "/vm/dirty-memory-ranges")


async def test_missing_socket_is_a_connection_error(tmp_path: Path) -> None:
    async with FirecrackerApi(tmp_path / "nothing.sock") as api:
        with pytest.raises(FirecrackerConnectionError, match="did not answer"):
            await api.describe_instance()


async def test_malformed_answer_is_reported(peer: PeerState, tmp_path: Path) -> None:
    peer.vm_id = None  # type: ignore[assignment]  # the peer now answers GET / without an id
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerError, match="unexpected answer to GET /"):
            await api.describe_instance()


async def test_the_double_refuses_what_firecracker_cannot_use(
    peer: PeerState, tmp_path: Path
) -> None:
    """qcow2 drives (Firecracker reads raw images only), a start before the machine config, and
    a snapshot load after boot-specific configuration or of a state whose drive became a qcow2."""
    (tmp_path / "vmlinux").touch()
    (tmp_path / "raw.img").write_bytes(b"\0" * 4096)
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "q.img"), "1M"], check=True
    )
    drive = m.Drive(
        drive_id="upper", is_root_device=False, path_on_host="q.img", is_read_only=False
    )
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerApiError, match="qcow2"):
            await api.put_drive(drive)
        await api.put_boot_source(m.BootSource(kernel_image_path="vmlinux"))
        with pytest.raises(FirecrackerApiError, match="machine-config"):
            await api.start()
        with pytest.raises(FirecrackerApiError, match="boot-specific"):
            await api.load_snapshot(
                m.SnapshotLoadParams(
                    snapshot_path="s",
                    mem_backend=m.MemoryBackend(backend_type="File", backend_path="m"),
                )
            )
        await api.put_machine_config(m.MachineConfiguration(vcpu_count=1, mem_size_mib=1))
        await api.put_drive(drive.model_copy(update={"path_on_host": "raw.img"}))
        await api.start()
        await api.pause()
        await api.create_snapshot(m.SnapshotCreateParams(snapshot_path="s", mem_file_path="m"))

    # The drive is a qcow2 by the time a new process loads the snapshot.
    (tmp_path / "q.img").replace(tmp_path / "raw.img")
    peer.state, peer.config, peer.requests = "Not started", {}, []
    async with FirecrackerApi(tmp_path / "api.sock") as api:
        with pytest.raises(FirecrackerApiError, match="qcow2"):
            await api.load_snapshot(
                m.SnapshotLoadParams(
                    snapshot_path="s",
                    mem_backend=m.MemoryBackend(backend_type="File", backend_path="m"),
                )
            )
