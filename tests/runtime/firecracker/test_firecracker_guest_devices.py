"""How the Debian guest kernel finds Firecracker's virtio-mmio devices (see the module docstring of
`aenv.runtime.firecracker.driver`): not through `virtio_mmio.device=` command-line arguments
(`CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES` is not set) but through ACPI, with `virtio_mmio` a module our
initramfs loads. So the driver hands the kernel our command line unchanged: nothing of its own,
never `acpi=off`."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from elftools.elf.elffile import ELFFile

from aenv.guest.cmdline import GuestNet, kernel_cmdline
from aenv.guest.initramfs import MODULES
from aenv.guest.kernel import fetch_kernel
from aenv.runtime import driver as d
from aenv.runtime.firecracker import FirecrackerDriver
from aenv.runtime.firecracker.vm import FirecrackerVM
from tests.runtime.firecracker.fc_peer import RECORD_PATH
from tests.support.guest import GUEST_CACHE


def _extracted_kernel() -> Path:
    """The root of the Debian kernel package the guest images use, as the image build extracts
    it into the shared guest cache (built here if no suite has yet)."""
    kernel = asyncio.run(fetch_kernel(GUEST_CACHE))
    return kernel.bzimage.parent.parent


def _config(root: Path) -> dict[str, str]:
    options = {}
    for line in next(root.glob("boot/config-*")).read_text().splitlines():
        if line.startswith("CONFIG_"):
            key, _, value = line.partition("=")
            options[key] = value
        elif line.startswith("# CONFIG_") and line.endswith(" is not set"):
            options[line[2:].split()[0]] = "n"
    return options


def test_debian_kernel_sees_virtio_mmio_devices_through_acpi_only() -> None:
    root = _extracted_kernel()
    config = _config(root)
    assert config["CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES"] == "n"  # virtio_mmio.device= is ignored
    assert config["CONFIG_ACPI"] == "y"
    assert config["CONFIG_VIRTIO_MMIO"] == "m"  # a module: the initramfs must load it
    assert "virtio_mmio" in MODULES
    module = next(root.glob("lib/modules/*/kernel/drivers/virtio/virtio_mmio.ko"))
    with module.open("rb") as f:
        section = ELFFile(f).get_section_by_name(".modinfo")
        assert section is not None
        modinfo = section.data().split(b"\0")
    assert b"alias=acpi*:LNRO0005:*" in modinfo  # binds the devices Firecracker lists in ACPI
    # Firecracker's balloon and entropy devices have guest drivers the initramfs loads too.
    assert config["CONFIG_VIRTIO_BALLOON"] == "m" and "virtio_balloon" in MODULES
    assert config["CONFIG_HW_RANDOM_VIRTIO"] == "m" and "virtio_rng" in MODULES


async def test_driver_passes_the_guest_command_line_unchanged(
    driver: FirecrackerDriver, spec: d.VMSpec
) -> None:
    cmdline = kernel_cmdline(GuestNet("10.0.2.15/24", "10.0.2.2", "1.1.1.1"), hostname="sandbox")
    vm = await driver.boot(replace(spec, cmdline=cmdline))
    try:
        assert isinstance(vm, FirecrackerVM)
        requests = (await vm.api._call("GET", RECORD_PATH)).json()
        boot_args = next(
            r["body"]["boot_args"]
            for r in requests
            if (r["method"], r["path"]) == ("PUT", "/boot-source")
        )
    finally:
        await vm.stop()
    # Firecracker appends its own virtio_mmio.device= arguments (this kernel ignores them); the
    # driver adds none, and never acpi=off, through which alone this kernel finds the devices.
    assert boot_args == cmdline
    assert "virtio_mmio.device=" not in boot_args and "acpi=off" not in boot_args.split()
