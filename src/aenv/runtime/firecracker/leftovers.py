"""What Firecracker VMs leave behind when the process that ran them is killed (SIGKILL: no `stop()`
ran), and removing it at the next start; `aenv.runtime.sweep` kills the orphaned processes first.

- every VM: in its workdir (found as the directory of the killed Firecracker's stdout, the console
  log; or its working directory), what `stop()` would have removed: the console and log files,
  and for an unjailed VM the staged links under `boot/`, `drives/` and `restore/`, the API socket
  and a restored VM's private writable layers (`layers/<drive_id>.img`, found through the
  `drives/<drive_id>` link to it, a symlink in the workdir or a hard link or bind mount in the
  jail). The workdir itself is the caller's.
- unjailed VMs: their cgroups, the groups named `<id_prefix>...` under the driver's
  `cgroup_parent`.
- jailed VMs: the whole jail (`<chroot_base>/<exec name>/<id>/`), its bind mounts undone first,
  and the cgroups the jailer made.

VMs that are still running under a live owner are passed as `live` and left alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from aenv.runtime.cgroups import CgroupError, CgroupManager
from aenv.runtime.firecracker import host
from aenv.runtime.firecracker.config import FirecrackerConfig
from aenv.runtime.firecracker.jailer import sweep_jails
from aenv.runtime.firecracker.placement import API_SOCKET
from aenv.runtime.firecracker.vm import _LOG_FILES
from aenv.runtime.sweep import Vmm

# Where Firecracker's stdout (the guest's serial console) goes, in the VM's workdir.
CONSOLE_LOG = "console.log"
# Directories the driver stages files in (`Placement.stage` names).
STAGING_DIRS = ("boot", "drives", "restore")

log = logging.getLogger(__name__)


def remove_workdir_leftovers(workdir: Path, jail_root: Path | None = None) -> list[Path]:
    """The files a VM that was never stopped left in `workdir` (see the module docstring), with
    `jail_root` the root of its jail if it was jailed; returns what was removed."""
    removed: list[Path] = []
    layers_dir = workdir / "layers"
    drives = (jail_root or workdir) / "drives"
    if drives.is_dir() and not drives.is_symlink():
        for link in drives.iterdir():
            layer = layers_dir / f"{link.name}.img"
            with contextlib.suppress(OSError):
                if not layer.is_file() or layer.is_symlink():
                    continue
                if link.is_symlink():
                    ours = link.readlink() == layer.resolve()
                else:
                    ours = jail_root is not None and link.samefile(layer)
                if ours:
                    layer.unlink()
                    removed.append(layer)
    for sub in STAGING_DIRS:
        directory = workdir / sub
        if directory.is_symlink() or not directory.is_dir():
            continue
        for link in directory.iterdir():
            if link.is_symlink():
                link.unlink()
                removed.append(link)
        with contextlib.suppress(OSError):
            directory.rmdir()
            removed.append(directory)
    with contextlib.suppress(OSError):
        layers_dir.rmdir()  # only if empty: other files there are not ours
        removed.append(layers_dir)
    for name in (API_SOCKET, *_LOG_FILES):
        path = workdir / name
        if path.is_symlink() or path.is_dir():
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def _workdir(vmm: Vmm, jailed: bool) -> Path | None:
    if vmm.stdout is not None and vmm.stdout.name == CONSOLE_LOG:
        return vmm.stdout.parent
    return None if jailed else vmm.cwd


def reclaim(
    config: FirecrackerConfig,
    cgroups: Callable[[], CgroupManager],
    prefix: str,
    killed: Sequence[Vmm],
    live: Collection[str],
) -> list[Path]:
    """Remove what VMs named `prefix*` left (the `killed` Firecrackers and any that had died
    already), except for the VMs named in `live`. Blocking."""
    removed: list[Path] = []
    jail_base = config.jailer.chroot_base_dir.resolve() if config.jailer is not None else None
    for vmm in killed:
        if vmm.kind != "firecracker" or not vmm.name.startswith(prefix):
            continue
        jailed = vmm.cwd is not None and jail_base is not None and vmm.cwd.is_relative_to(jail_base)
        workdir = _workdir(vmm, jailed)
        if workdir is not None:
            removed += remove_workdir_leftovers(workdir, vmm.cwd if jailed else None)
    try:
        manager = cgroups()
    except CgroupError as exc:
        log.warning("no firecracker cgroups to sweep: %s", exc)
    else:
        for name in manager.names():
            if name.startswith(prefix) and name not in live:
                try:
                    removed += manager.remove_stale(name)
                except CgroupError as exc:
                    log.warning("stale firecracker cgroup %s stays: %s", name, exc)
    if config.jailer is not None:
        binary = host.find_binary(config.binary) or config.binary
        try:
            removed += sweep_jails(config.jailer, binary.name, prefix, live)
        except OSError as exc:
            log.warning("cannot sweep firecracker jails: %s", exc)
    return removed
