"""Volumes over a node on doubles, served on loopback and driven by the unmodified Python SDK:
create, list, info and delete with E2B's shapes; bad input answered with JSON errors and nothing
changed; `volumeMounts` on create reaching the driver (a share per volume, restored into a
share slot) and the guest's `/init`; pause, fork and snapshot of a sandbox with volumes have
its guest release them and keep its memory, and save its filesystem only when a volume is in
use or the VM has no share slots. The mounts themselves, in real guests, are tested in
tests/e2e/volumes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from e2b import AsyncSandbox, AsyncVolume
from e2b.exceptions import SandboxException, VolumeException

from aenv.orchestrator.catalog import Catalog, VolumeRecord
from aenv.orchestrator.kinds import SaveMode
from aenv.runtime.firecracker.driver import NO_SHARES
from tests.api.test_routes import KEY, error, served
from tests.doubles.driver import DoubleVM
from tests.doubles.node import DoubleNode, double_node


def _opts(api: Any) -> dict[str, Any]:
    return {"api_key": KEY, "api_url": str(api.base_url)}


def _vm(node: DoubleNode, sandbox_id: str) -> DoubleVM:
    return node.driver.running[node.orchestrator.guest_endpoint(sandbox_id).incarnation]


async def test_create_list_info_delete_with_the_sdk(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        volume = await AsyncVolume.create("data-1", **_opts(api))
        assert volume.volume_id and volume.name == "data-1" and volume.token
        assert node.orchestrator.volumes.directory(volume.volume_id).is_dir()
        listed = await AsyncVolume.list(**_opts(api))
        assert [(v.volume_id, v.name) for v in listed] == [(volume.volume_id, "data-1")]
        info = await AsyncVolume.get_info(volume.volume_id, **_opts(api))
        assert (info.name, info.token) == ("data-1", volume.token)
        assert await AsyncVolume.destroy(volume.volume_id, **_opts(api)) is True
        assert not node.orchestrator.volumes.directory(volume.volume_id).exists()
        assert await AsyncVolume.list(**_opts(api)) == []
        assert await AsyncVolume.destroy(volume.volume_id, **_opts(api)) is False


async def test_volumes_survive_a_restart_of_the_catalog(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        made = (await api.post("/volumes", json={"name": "kept"})).json()
        path = node.config.paths.catalog
    reopened = Catalog(path)
    try:
        found = reopened.volume(volume_id=made["volumeID"])
        assert found is not None and found.name == "kept" and found.token == made["token"]
    finally:
        reopened.close()


async def test_bad_volume_input_gets_json_errors_and_changes_nothing(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        await api.post("/volumes", json={"name": "taken"})
        for body, status in [
            ({"name": "taken"}, 400),  # names are unique
            ({"name": "a/b"}, 400),
            ({"name": ""}, 400),
            ({"name": "x" * 65}, 400),
            ({}, 400),
            ({"name": "ok", "size": 1}, 400),
        ]:
            assert error(await api.post("/volumes", json=body), status)
        assert "'size' is not supported here" in error(
            await api.post("/volumes", json={"name": "ok", "size": 1}), 400
        )
        assert error(await api.get("/volumes/vol_nope"), 404)
        assert error(await api.delete("/volumes/vol_nope"), 404)
        assert error(await api.get("/volumes", params={"x": "1"}), 400)
        assert [v.name for v in node.orchestrator.volumes.list()] == ["taken"]
        with pytest.raises(VolumeException, match="already exists"):
            await AsyncVolume.create("taken", **_opts(api))


async def test_a_volume_has_a_size_from_its_create_or_the_node(tmp_path: Path) -> None:
    async with double_node(tmp_path, volume_size_mb=300) as node, served(node) as api:
        default = await api.post("/volumes", json={"name": "default"})
        assert default.status_code == 201 and default.json()["sizeMB"] == 300
        sized = (await api.post("/volumes", json={"name": "sized", "sizeMB": 64})).json()
        assert sized["sizeMB"] == 64
        assert (await api.get(f"/volumes/{sized['volumeID']}")).json()["sizeMB"] == 64
        assert node.volume_backing.sizes == {default.json()["volumeID"]: 300, sized["volumeID"]: 64}
        # The SDK's create reads E2B's fields and ignores this node's.
        volume = await AsyncVolume.create("from-sdk", **_opts(api))
        assert node.orchestrator.volumes.get(volume.volume_id).size_mb == 300
        for size in (15, 1 << 21, "64", 64.5, True):
            problem = error(await api.post("/volumes", json={"name": "bad", "sizeMB": size}), 400)
            assert "sizeMB" in problem, problem
        assert [v.name for v in node.orchestrator.volumes.list()] == [
            "default",
            "sized",
            "from-sdk",
        ]


async def test_a_volume_the_disk_reserve_cannot_hold_is_refused(tmp_path: Path) -> None:
    # The reserve leaves room for one volume of 6000 MiB, not two: one not yet written counts
    # at its full size. The margins keep others' writes on this disk from deciding the test.
    free_mb = shutil.disk_usage(tmp_path).free >> 20
    reserve = free_mb - 10_000
    async with (
        double_node(tmp_path, reserve_disk_mb=reserve, volume_size_mb=6_000) as node,
        served(node) as api,
    ):
        first = await api.post("/volumes", json={"name": "first"})
        assert first.status_code == 201, first.text
        problem = error(await api.post("/volumes", json={"name": "second"}), 507)
        assert "not enough disk for a volume of 6000 MiB" in problem
        assert "6000 MiB unwritten in volumes" in problem
        with pytest.raises(VolumeException, match="not enough disk"):
            await AsyncVolume.create("second", **_opts(api))
        assert [v.name for v in node.orchestrator.volumes.list()] == ["first"]
        assert not (node.config.paths.volumes / "second").exists()
        node.volume_backing.make_fails = True
        failed = await api.post("/volumes", json={"name": "second", "sizeMB": 1_000})
        assert failed.status_code == 500 and "mkfs.ext4" not in failed.text  # logged, not shown
        assert [v.name for v in node.orchestrator.volumes.list()] == ["first"]
        node.volume_backing.make_fails = False
        smaller = await api.post("/volumes", json={"name": "second", "sizeMB": 1_000})
        assert smaller.status_code == 201, smaller.text
        assert (await api.delete(f"/volumes/{first.json()['volumeID']}")).status_code == 204
        again = await api.post("/volumes", json={"name": "third"})
        assert again.status_code == 201, again.text


async def test_volumes_are_attached_while_the_node_runs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with double_node(tmp_path) as first, served(first) as api:
        kept = (await api.post("/volumes", json={"name": "kept"})).json()["volumeID"]
        broken = (await api.post("/volumes", json={"name": "broken"})).json()["volumeID"]
        busy = (await api.post("/volumes", json={"name": "busy"})).json()["volumeID"]
        backing = first.volume_backing
        assert backing.attached == {kept, broken, busy}
        backing.busy.add(busy)
        assert "is in use" in error(await api.delete(f"/volumes/{busy}"), 409)
        assert first.orchestrator.volumes.get(busy).name == "busy"
        backing.busy.clear()
        # A volume made before sizes: a plain directory, no size.
        first.catalog.insert_volume(VolumeRecord("vol_old", "old", "token", 0.0))
        (first.config.paths.volumes / "vol_old").mkdir()
    assert backing.attached == set()  # the node's stop detached them
    backing.broken.add(broken)
    node = first.reopen()
    await node.orchestrator.start()
    try:
        assert backing.attached == {kept, busy}
        assert "volume vol_old (old) has no size" in caplog.text
        async with served(node) as api:
            assert (await api.get("/volumes/vol_old")).json()["sizeMB"] is None
            body = {"templateID": "base", "volumeMounts": [{"name": "broken", "path": "/b"}]}
            problem = error(await api.post("/v2/sandboxes", json=body), 400)
            assert "volume 'broken' is unavailable: its image is not mounted" in problem
            assert node.catalog.list() == []
            assert (await api.delete(f"/volumes/{broken}")).status_code == 204
            assert broken not in node.orchestrator.volumes.unavailable
            body = {"templateID": "base", "volumeMounts": [{"name": "old", "path": "/o"}]}
            legacy = await api.post("/v2/sandboxes", json=body)
            assert legacy.status_code == 201, legacy.text
            await api.delete(f"/sandboxes/{legacy.json()['sandboxID']}")
            assert (await api.delete("/volumes/vol_old")).status_code == 204
            assert not (node.config.paths.volumes / "vol_old").exists()
    finally:
        await node.orchestrator.close()
        node.catalog.close()


async def test_bad_mounts_are_refused_and_start_nothing(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        await api.post("/volumes", json={"name": "v"})
        for mounts, problem in [
            ([{"name": "missing", "path": "/mnt/a"}], "volume 'missing' not found"),
            ([{"name": "v", "path": "relative"}], "must be an absolute path"),
            ([{"name": "v", "path": "/mnt/../etc"}], "must not contain '..'"),
            ([{"name": "v", "path": "/"}], "would hide the guest's system files"),
            ([{"name": "v", "path": "/proc/x"}], "would hide the guest's system files"),
            # What normalising gives a system directory or one of its parents is one too.
            ([{"name": "v", "path": "//etc"}], "would hide the guest's system files"),
            ([{"name": "v", "path": "///usr/./"}], "would hide the guest's system files"),
            ([{"name": "v", "path": "/lib64"}], "would hide the guest's system files"),
            ([{"name": "v", "path": "/var"}], "would hide the guest's system files"),
            ([{"name": "v", "path": "/root"}], "would hide the guest's system files"),
            ([{"name": "v", "path": "/opt"}], "would hide the guest's system files"),  # envd's
            ([{"name": "v", "path": "/a"}, {"name": "v", "path": "/a/"}], "two volumes"),
            ([{"name": "v", "path": "/a", "readOnly": True}], "'volumeMounts.0.readOnly'"),
        ]:
            body = {"templateID": "base", "volumeMounts": mounts}
            assert problem in error(await api.post("/v2/sandboxes", json=body), 400)
        with pytest.raises(SandboxException, match="volume 'missing' not found"):
            await AsyncSandbox.create("base", volume_mounts={"/mnt/a": "missing"}, **_opts(api))
        assert node.catalog.list() == []


async def test_mounts_inside_user_and_data_directories_are_allowed(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        await api.post("/volumes", json={"name": "v"})
        paths = ["/home/user/x", "/mnt/data", "/var/lib/db", "/root/work", "/opt/tool"]
        for path in paths:
            body = {"templateID": "base", "volumeMounts": [{"name": "v", "path": path}]}
            created = await api.post("/v2/sandboxes", json=body)
            assert created.status_code == 201, created.text
        assert sorted(r.volume_mounts[0].path for r in node.catalog.list()) == sorted(paths)


async def test_mounts_reach_the_driver_and_the_guest(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        volume = await AsyncVolume.create("shared", **_opts(api))
        sandbox = await AsyncSandbox.create(
            "base", volume_mounts={"/mnt/data": volume}, **_opts(api)
        )
        vm = _vm(node, sandbox.sandbox_id)
        assert [s.path for s in vm.spec.shares] == [
            node.orchestrator.volumes.directory(volume.volume_id)
        ]
        assert vm.guest.volume_mounts == [{"tag": "aenv-vol0", "path": "/mnt/data"}]
        detail = (await api.get(f"/sandboxes/{sandbox.sandbox_id}")).json()
        assert detail["volumeMounts"] == [{"name": "shared", "path": "/mnt/data"}]
        # Mounted: not deleted, and the volume is as it was.
        assert "is mounted by sandbox" in error(
            await api.delete(f"/volumes/{volume.volume_id}"), 409
        )
        assert node.orchestrator.volumes.directory(volume.volume_id).is_dir()
        await sandbox.kill()
        assert await AsyncVolume.destroy(volume.volume_id, **_opts(api)) is True


async def _with_volume(node: DoubleNode, api: Any) -> str:
    await api.post("/volumes", json={"name": "v"})
    body = {"templateID": "base", "volumeMounts": [{"name": "v", "path": "/v"}]}
    return str((await api.post("/v2/sandboxes", json=body)).json()["sandboxID"])


async def test_pause_fork_and_snapshot_release_the_volumes_and_keep_memory(
    tmp_path: Path,
) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await _with_volume(node, api)
        boots = node.driver.calls["boot"]
        forked = await api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": 1})
        assert forked.status_code == 201, forked.text
        child = forked.json()[0]["sandbox"]["sandboxID"]
        assert (
            node.orchestrator.get(child).volume_mounts
            == node.orchestrator.get(sandbox_id).volume_mounts
        )
        assert _vm(node, child).guest.volume_mounts == [{"tag": "aenv-vol0", "path": "/v"}]
        assert _vm(node, child).guest.volumes_mounted
        # The source unmounted its volume for the save, and mounted it again after.
        source = _vm(node, sandbox_id).guest
        assert source.volume_releases == 1 and source.volumes_mounted
        snap = await api.post(f"/sandboxes/{sandbox_id}/snapshots", json={})
        assert snap.status_code == 201, snap.text
        assert node.templates.get(snap.json()["snapshotID"]).save_mode is SaveMode.FULL
        assert source.volume_releases == 2 and source.volumes_mounted
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert node.orchestrator.get(sandbox_id).checkpoint_mode is SaveMode.FULL
        resumed = await api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
        assert resumed.status_code == 201, resumed.text
        guest = _vm(node, sandbox_id).guest
        assert guest.volume_mounts == [{"tag": "aenv-vol0", "path": "/v"}]
        assert guest.volumes_mounted and _vm(node, sandbox_id).spec.shares
        assert node.driver.calls["boot"] == boots  # every start a restore


async def test_a_volume_in_use_saves_the_filesystem_and_a_failed_save_remounts(
    tmp_path: Path,
) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await _with_volume(node, api)
        guest = _vm(node, sandbox_id).guest
        node.driver.fail_next("snapshot")
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code >= 500
        assert node.orchestrator.get(sandbox_id).state.value == "running"
        assert guest.volume_releases == 1 and guest.volumes_mounted
        guest.volumes_busy = True
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert node.orchestrator.get(sandbox_id).checkpoint_mode is SaveMode.FILESYSTEM
        assert guest.syncs == 1  # flushed for the filesystem save
        boots = node.driver.calls["boot"]
        resumed = await api.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
        assert resumed.status_code == 201, resumed.text
        assert node.driver.calls["boot"] == boots + 1
        assert _vm(node, sandbox_id).guest.volume_mounts == [{"tag": "aenv-vol0", "path": "/v"}]


async def test_a_vm_booted_without_share_slots_saves_the_filesystem(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        sandbox_id = await _with_volume(node, api)
        vm = _vm(node, sandbox_id)
        # As a VM an older version booted: its devices are its shares alone.
        vm.spec = dataclasses.replace(vm.spec, share_slots=0)
        assert (await api.post(f"/sandboxes/{sandbox_id}/pause")).status_code == 204
        assert node.orchestrator.get(sandbox_id).checkpoint_mode is SaveMode.FILESYSTEM
        assert vm.guest.volume_releases == 0


async def _aenv(api: Any, *args: str) -> tuple[int, str, str]:
    env = {**os.environ, "E2B_API_URL": str(api.base_url), "E2B_API_KEY": KEY}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "aenv.cli", "volumes", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_cli_manages_volumes(tmp_path: Path) -> None:
    async with double_node(tmp_path) as node, served(node) as api:
        code, out, _ = await _aenv(api, "create", "from-cli")
        volume_id = out.strip()
        assert code == 0 and node.orchestrator.volumes.get(volume_id).name == "from-cli"
        code, out, _ = await _aenv(api, "list", "--json")
        assert json.loads(out) == [{"volumeID": volume_id, "name": "from-cli"}]
        code, out, _ = await _aenv(api, "create", "sized", "--size-mb", "64")
        assert code == 0 and node.orchestrator.volumes.get(out.strip()).size_mb == 64
        await _aenv(api, "delete", out.strip())
        code, _, err = await _aenv(api, "create", "from-cli")
        assert code == 1 and "already exists" in err
        code, out, _ = await _aenv(api, "delete", volume_id)
        assert code == 0 and out.strip() == volume_id and node.orchestrator.volumes.list() == []
        code, _, err = await _aenv(api, "delete", volume_id)
        assert code == 1 and "404" in err


async def test_a_node_without_shared_filesystems_refuses_mounts_by_name(tmp_path: Path) -> None:
    async with double_node(tmp_path) as first:
        first.driver.shares_refused = NO_SHARES  # the double plays a Firecracker node
        node = first.reopen()
        await node.orchestrator.start()
        try:
            async with served(node) as api:
                await api.post("/volumes", json={"name": "v"})
                body = {"templateID": "base", "volumeMounts": [{"name": "v", "path": "/mnt/v"}]}
                problem = error(await api.post("/v2/sandboxes", json=body), 400)
                assert problem.startswith("volumeMounts: volumes cannot be mounted on this node")
                assert NO_SHARES in problem
                with pytest.raises(SandboxException, match="volumeMounts: volumes cannot"):
                    await AsyncSandbox.create("base", volume_mounts={"/mnt/v": "v"}, **_opts(api))
                assert node.catalog.list() == [] and node.driver.running == {}
                plain = await api.post("/v2/sandboxes", json={"templateID": "base"})
                assert plain.status_code == 201, plain.text
        finally:
            await node.orchestrator.close()
            node.catalog.close()
