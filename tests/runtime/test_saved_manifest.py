"""`snapshot.json`'s format version and checksums: a saved state whose files changed since its
save, or whose manifest is another program's or a newer format's, is refused by name; one
written before versions still loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from aenv.runtime import checksums, export
from aenv.runtime.checksums import Checksum
from aenv.runtime.driver import (
    MANIFEST_VERSION,
    SNAPSHOT_MANIFEST,
    CorruptSavedState,
    RestoreError,
    Snapshot,
    UnknownSavedStateFormat,
    VMSpec,
)

MIB = 1 << 20


def _saved(directory: Path) -> Snapshot:
    """A complete saved state of the double driver's kind: state, memory, a layer, a disk."""
    files = {"state": b"device state", "memory": b"guest pages" * 1000, "layer-1": b"older"}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    (directory / "upper.img").write_bytes(b"\0" * MIB + b"a block of the disk")
    spec = VMSpec(vcpus=1, memory_mib=256, kernel=Path("/k"), cmdline="", workdir=directory)
    return Snapshot(
        driver="double",
        compat="x",
        spec=spec,
        state_file=directory / "state",
        memory_file=directory / "memory",
        disks={"upper": directory / "upper.img"},
        layers=(directory / "layer-1",),
    )


def _flip(path: Path, offset: int) -> None:
    """Change one byte in place, as a disk error or a stray write would."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_manifest_records_version_and_every_files_checksum(tmp_path: Path) -> None:
    snapshot = _saved(tmp_path)
    snapshot.save_manifest()
    raw = json.loads((tmp_path / SNAPSHOT_MANIFEST).read_text())
    assert (raw["format"], raw["version"]) == ("aenv-saved-state", MANIFEST_VERSION)
    assert set(raw["files"]) == {"state", "memory", "layer-1", "disk-upper"}
    assert raw["files"]["state"] == {
        "size": 12,
        "xxh3-128": checksums.of_file(tmp_path / "state").digest,
    }
    loaded = export.load(tmp_path, "double")
    assert loaded == snapshot
    assert loaded.recorded["disk-upper"] == checksums.of_file(tmp_path / "upper.img")


@pytest.mark.parametrize(
    ("name", "role", "offset"),
    [("state", "state", 3), ("upper.img", "disk-upper", MIB + 2), ("layer-1", "layer-1", 0)],
)
def test_a_changed_byte_is_refused_by_file(
    tmp_path: Path, name: str, role: str, offset: int
) -> None:
    _saved(tmp_path).save_manifest()
    _flip(tmp_path / name, offset)
    with pytest.raises(CorruptSavedState) as refused:
        export.load(tmp_path, "double")
    assert str(refused.value) == (
        f"saved state in {tmp_path} is corrupt: file {role} ({tmp_path / name}) checksum mismatch"
    )


def test_a_cut_file_is_refused_with_its_sizes(tmp_path: Path) -> None:
    _saved(tmp_path).save_manifest()
    os.truncate(tmp_path / "memory", 5)
    with pytest.raises(
        CorruptSavedState, match=r"file memory .* has 5 bytes, its manifest recorded 11000"
    ):
        export.load(tmp_path, "double")


def test_a_manifest_naming_other_files_than_it_recorded_is_refused(tmp_path: Path) -> None:
    _saved(tmp_path).save_manifest()
    manifest = tmp_path / SNAPSHOT_MANIFEST
    raw = json.loads(manifest.read_text())
    raw["layers"] = []  # the layer dropped from the list, its checksum still recorded
    manifest.write_text(json.dumps(raw))
    with pytest.raises(CorruptSavedState, match="records the files"):
        export.load(tmp_path, "double")


def test_a_state_saved_before_versions_loads_without_checksums(tmp_path: Path) -> None:
    """The manifest exactly as the code before format versions wrote it (`_snapshot_to_dict`
    at cb523f7): no `format`, `version` or `files`."""
    expected = _saved(tmp_path)
    old = {
        "driver": "double",
        "compat": "x",
        "spec": {
            "vcpus": 1,
            "memory_mib": 256,
            "kernel": "/k",
            "cmdline": "",
            "workdir": str(tmp_path),
            "initrd": None,
            "disks": [],
            "net": None,
            "memory_dir": None,
            "limits": {"memory_max_mib": None, "pids_max": None, "cpu_cores": None},
            "share_slots": 0,
        },
        "state_file": str(tmp_path / "state"),
        "memory_file": str(tmp_path / "memory"),
        "disks": {"upper": str(tmp_path / "upper.img")},
        "machine_state": True,
        "layers": [str(tmp_path / "layer-1")],
    }
    (tmp_path / SNAPSHOT_MANIFEST).write_text(json.dumps(old, indent=2))
    _flip(tmp_path / "state", 0)  # nothing recorded to compare with: version 1 trusts its files
    loaded = export.load(tmp_path, "double")
    assert loaded == expected and loaded.recorded == {}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"format": "aenv-saved-state", "version": MANIFEST_VERSION + 1},
            f"was written by format version {MANIFEST_VERSION + 1}, this node reads versions 1 "
            f"to {MANIFEST_VERSION}",
        ),
        ({"format": "firecracker-vmstate", "version": 2}, "is not aenv's"),
        ({"format": None, "version": 2}, "is not aenv's"),
        ({"format": "aenv-saved-state", "version": "2"}, "written by format version 2,"),
    ],
)
def test_a_foreign_or_newer_manifest_is_refused(
    tmp_path: Path, header: dict[str, object], message: str
) -> None:
    _saved(tmp_path).save_manifest()
    manifest = tmp_path / SNAPSHOT_MANIFEST
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), **header}))
    with pytest.raises(UnknownSavedStateFormat, match=message):
        Snapshot.load_manifest(tmp_path)
    assert issubclass(UnknownSavedStateFormat, RestoreError)


def test_checksum_is_of_the_content_not_its_holes(tmp_path: Path) -> None:
    """A sparse file and a dense copy (zeros written out) have one checksum; one byte apart,
    they differ; and a write in place is seen although the size stays."""
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    with sparse.open("wb") as f:
        f.truncate(8 * MIB + 7)
        f.seek(3 * MIB + 5)
        f.write(b"data amid holes")
    dense.write_bytes(sparse.read_bytes())
    assert checksums.of_file(sparse) == checksums.of_file(dense)
    before = checksums.of_file(dense)
    _flip(dense, 8 * MIB + 6)  # in the short last block
    after = checksums.of_file(dense)
    assert after.size == before.size and after != before
    assert checksums.of_file(tmp_path / "sparse") == Checksum(8 * MIB + 7, before.digest)
