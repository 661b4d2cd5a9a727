"""What this host offers Firecracker: the binary, and the facts a snapshot is tied to.

A Firecracker snapshot restores only on the same kind of virtualization (KVM vs PVM, whose guests
differ) and CPU model, and on a Firecracker whose snapshot format matches; `compat_tag` writes
those down and `check_compat` compares them before a restore is attempted. (Whether KVM really
runs guests is decided by booting one: `aenv.runtime.select`.)
"""

from __future__ import annotations

import shutil
from pathlib import Path


def accelerator(sys_module: Path = Path("/sys/module")) -> str:
    """'pvm' on hosts whose KVM is the PVM flavour (no hardware virtualization), else 'kvm'."""
    hardware = (sys_module / "kvm_intel").exists() or (sys_module / "kvm_amd").exists()
    return "pvm" if (sys_module / "kvm_pvm").exists() and not hardware else "kvm"


def cpu_model(cpuinfo: str | None = None) -> str:
    text = cpuinfo if cpuinfo is not None else Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return "unknown"


def compat_tag(firecracker_version: str) -> str:
    return f"firecracker/{firecracker_version}/{accelerator()}/{cpu_model()}"


def check_compat(snapshot_tag: str, firecracker_version: str) -> str | None:
    """Why a snapshot tagged `snapshot_tag` cannot restore here, or None if it can. Firecracker's
    snapshot format follows its minor version, so patch releases may differ."""
    parts = snapshot_tag.split("/", 3)
    if len(parts) != 4 or parts[0] != "firecracker":
        return f"not a firecracker snapshot tag: {snapshot_tag!r}"
    _, version, accel, model = parts
    if accel != accelerator():
        return f"snapshot taken under {accel}, this host runs {accelerator()}"
    if model != cpu_model():
        return f"snapshot taken on CPU {model!r}, this host has {cpu_model()!r}"
    if version.split(".")[:2] != firecracker_version.split(".")[:2]:
        return f"snapshot from firecracker {version}, this host runs {firecracker_version}"
    return None


def find_binary(name_or_path: str | Path) -> Path | None:
    found = shutil.which(str(name_or_path))
    return Path(found) if found else None
