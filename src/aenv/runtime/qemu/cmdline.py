"""A VMM's command line, and what it names: the guest's memory file (`Memory`), drives with their
discard options, the tap, the 9p shares, and the files a jailed VMM may open (`jail_files`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aenv.runtime import qcow2
from aenv.runtime.driver import Disk, DriverError, VMSpec, share_tag
from aenv.runtime.jail import SECCOMP, Access, JailFile, host_binary
from aenv.runtime.qemu.config import QemuConfig
from aenv.runtime.qemu.platform import Platform
from aenv.runtime.sweep import VMM_NAME_PREFIX

RAM_BLOCK = "mem"  # the guest RAM's backend id, hence its RAM block's name in streams
# How a VM's 9p shares (volumes) store files. mapped-xattr: the guest's owner and mode live in
# extended attributes, so guests see and change them as on any filesystem (a jailed VMM could
# not chown the host files). On the host every file is readable and writable by all (fmode,
# dmode; the VMM runs with umask 0): the VMMs of other sandboxes, each with its own uid, share
# them, while the volumes directory (0700, root) keeps host users out.
SHARE_FILE_MODES = "security_model=mapped-xattr,fmode=0666,dmode=0777"
# What an unused share slot exports: empty, read-only, the same for every VMM (root's, 0755).
EMPTY_SHARE = Path("/run/aenv/empty-share")


@dataclass(frozen=True)
class Memory:
    """The file a VMM maps as guest RAM (always `id=mem`, so RAM block names match across
    processes)."""

    path: Path
    shared: bool  # share=on: we own the file; share=off: private mapping of a snapshot's file
    owned: bool  # delete on stop


def memory_dir(spec: VMSpec) -> Path:
    return spec.memory_dir or spec.workdir


def opt(value: object) -> str:
    """Escape a value for QEMU's comma-separated option syntax."""
    return str(value).replace(",", ",,")


def argv(
    config: QemuConfig,
    vm_id: str,
    spec: VMSpec,
    memory: Memory,
    qmp: Path,
    console: Path,
    tap_fd: int,
    platform: Platform,
    incoming: bool,
) -> list[str]:
    """The VMM's command line, its vCPUs stopped (`-S`). Blocking: reads disk headers."""
    accel = "kvm" if config.accel == "kvm" else f"tcg,tb-size={config.tb_size_mib}"
    shared_memory = "on" if memory.shared else "off"
    jailed = config.jail is not None
    args = [
        str(host_binary(config.binary)) if jailed else config.binary,
        "-name", f"{VMM_NAME_PREFIX}{vm_id}",  # lets the sweeps recognise our VMMs
        "-accel", accel,
        "-M", f"{platform.machine},memory-backend={RAM_BLOCK}",
        "-cpu", platform.cpu,
        "-smp", str(spec.vcpus),
        "-m", f"{spec.memory_mib}M",
        "-object",
        f"memory-backend-file,id={RAM_BLOCK},size={spec.memory_mib}M,"
        f"mem-path={opt(memory.path)},share={shared_memory}",
        "-display", "none",
        "-monitor", "none",
        "-no-reboot",
        "-no-user-config",
        # append=on: writes land at the file's end even after it was truncated (the
        # orchestrator caps console files, see orchestrator/consoles.py).
        "-chardev", f"file,id=con,path={opt(console)},append=on",
        "-serial", "chardev:con",
        "-qmp", f"unix:{opt(qmp)}",
        "-S",
    ]  # fmt: skip
    if not incoming:
        # A restored guest booted long ago: QEMU would hold a copy of the kernel and
        # initrd for the firmware (fw_cfg) all its life, ≈ 11 MiB a VMM, never read again.
        args += ["-kernel", str(spec.kernel), "-append", spec.cmdline]
        if spec.initrd:
            args += ["-initrd", str(spec.initrd)]
    if jailed:
        args += ["-sandbox", SECCOMP]
    for disk in spec.disks:
        fmt = "qcow2" if qcow2.is_qcow2(disk.path) else "raw"
        ro = "on" if disk.read_only else "off"
        drive = f"id={disk.drive_id},file={opt(disk.path)},format={fmt},if=none,readonly={ro}"
        args += [
            "-drive", drive + _discard(config, disk),
            "-device", f"virtio-blk-device,drive={disk.drive_id}",
        ]  # fmt: skip
    if spec.net:
        args += [
            "-netdev", f"tap,id=net0,fd={tap_fd}",
            "-device", f"virtio-net-device,netdev=net0,mac={spec.net.mac}",
        ]  # fmt: skip
    empty = _empty_share() if spec.share_slots > len(spec.shares) else None
    for i in range(spec.share_slots):
        if i < len(spec.shares):
            fsdev = f"path={opt(spec.shares[i].path)},{SHARE_FILE_MODES}"
        else:
            fsdev = f"path={opt(empty)},security_model=none,readonly=on"
        args += [
            "-fsdev", f"local,id=fs{i},{fsdev}",
            "-device", f"virtio-9p-device,fsdev=fs{i},mount_tag={share_tag(i)}",
        ]  # fmt: skip
    return args


def discard_options(config: QemuConfig) -> dict[str, str]:
    """Options of a writable drive's top that give the host back what the guest frees: its
    discards (the guest mounts the drive with `discard`) punch holes in the top, and blocks
    it overwrites with zeros are unmapped rather than stored."""
    return {"discard": "unmap", "detect-zeroes": "unmap"} if config.discard else {}


def _discard(config: QemuConfig, disk: Disk) -> str:
    if disk.read_only:
        return ""
    return "".join(f",{key}={value}" for key, value in discard_options(config).items())


def jail_files(spec: VMSpec, memory: Memory, qmp: Path, console: Path) -> list[JailFile]:
    """What the VMM opens by path, with the access it needs (see `aenv.runtime.jail`).
    Blocking: reads disk headers."""
    files = [JailFile(p, Access.READ) for p in (spec.kernel, spec.initrd) if p]
    for disk in spec.disks:
        below = qcow2.chain(disk.path)
        if not disk.read_only:
            files.append(JailFile(below.pop(0), Access.OWN))
        files += [JailFile(p, Access.READ) for p in below]
    files += [JailFile(share.path, Access.SHARED_DIR) for share in spec.shares]
    if spec.share_slots > len(spec.shares):
        files.append(JailFile(EMPTY_SHARE, Access.READ))
    mapped = Access.OWN if memory.owned else Access.SHARED_WRITE
    return [*files, JailFile(memory.path, mapped), JailFile(qmp, Access.OWN),
            JailFile(console, Access.OWN)]  # fmt: skip


def check_share_tags(spec: VMSpec, error: type[DriverError]) -> None:
    """Shares must carry their slots' tags (`share_tag`): the guest knows its devices by them."""
    wrong = [s.tag for i, s in enumerate(spec.shares) if s.tag != share_tag(i)]
    if wrong:
        raise error(f"share tags {wrong} are not their slots' ({share_tag(0)}, ...)")


def _empty_share() -> Path:
    """`EMPTY_SHARE`, made if missing (blocking)."""
    EMPTY_SHARE.mkdir(mode=0o755, parents=True, exist_ok=True)
    return EMPTY_SHARE
